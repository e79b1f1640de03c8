"""Measure one training step of any model on fake tensors: per-rank memory and every
collective, with no hardware and no per-model formula.

NOTE [fake measurement]
    ``measure`` builds the model on the meta device (``build("meta")``), shards it with
    ``meshlm.shard`` on a mesh of the fake process group (``backend="fake"``: every
    collective is a no-op with the right shapes) and runs what ``meshlm train`` runs, under
    torch's ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no data):
    ``train.grad_accum`` micro-batches of forward and backward on this rank's slice of the
    tokens and targets, then the optimizer step (``ShardedOptimizer`` over AdamW), twice.
    The second step is measured as ``meshlm train`` measures its own (NOTE [run memory] in
    meshlm/train/metrics.py), so the two compare directly:

    - ``params``, ``grads`` (after the last backward or in the step, whichever holds
      more), ``optimizer`` (after the step):
      the storages of parameters, gradients (``.grad``, main gradients, the masters'),
      masters and optimizer state, each counted once;
    - ``activations`` and ``gathered``: the storages the first forward made that are still
      alive when it returns, less the parameters, the inputs and the loss: what autograd
      and checkpointing hold for backward, split into the parameter copies (``gathered``,
      NOTE [parameter copies]) and the rest;
    - ``peak``: the most storage alive at once during the step, model state included
      (``meshlm.runtime.memory.PeakStorage``);
    - ``comm``: every collective of the step (``meshlm.runtime.comm.CommCounter``), as
      count, logical bytes and wire bytes per (kind, mesh axes, phase);
    - ``flops``: this rank's floating-point operations in a step (counted in the first)
      (``torch.utils.flop_counter.FlopCounterMode``: matmuls and attention, recompute
      included).

    A model of many identical blocks is measured on a few and the rest counted (NOTE
    [counted blocks] in repeats.py).  Storages are told apart by their storage object, never by data pointers (a fake
    tensor has none).  This process plays rank 0; every rank holds the same shapes except
    where a dim does not divide evenly, where rank 0 holds the largest shard.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from meshlm import _torch_compat as compat
from meshlm._torch_compat import TorchDispatchMode
from meshlm.core.errors import ConfigError
from meshlm.plan.where import Where, unmeasurable
from meshlm.runtime.comm import CommCounter

Build = Callable[[str], torch.nn.Module]


@dataclass
class Measured:
    """One fake step's figures, per rank (NOTE [fake measurement])."""

    memory: dict[str, int]  # params, grads, optimizer, activations, gathered, peak
    #: (kind, mesh axes, phase) -> {count, bytes (logical), wire_bytes}
    comm: dict[tuple, dict[str, float]]
    flops: int
    psi: int  # parameters of the model
    #: offloaded kinds: {kind: {bytes, in_bytes, out_bytes}} per rank (NOTE [planned offload])
    offload: dict = field(default_factory=dict)
    #: per scope of a scoped layout, its model state (NOTE [planned scopes] in plan/scopes.py)
    scopes: dict = field(default_factory=dict)
    #: a mixture of experts' figures (NOTE [planned experts] in plan/moe.py); {} without MoE layers
    moe: dict = field(default_factory=dict)


def _local(t):
    from meshlm.runtime.memory import local_data

    return local_data(t)


def _key(t) -> int:
    return compat.storage_key(_local(t).untyped_storage())


def _nbytes(ts) -> dict[int, int]:
    """Storage -> bytes for the tensors ``ts`` (None skipped), each storage once."""
    out = {}
    for t in ts:
        if t is not None:
            st = _local(t).untyped_storage()
            out[compat.storage_key(st)] = st.nbytes()
    return out


class _WaitIsIdentity(TorchDispatchMode):
    """``wait_tensor`` returns its input, as a real collective's wait does; the fake
    kernel returns a new tensor, which would count the collective's output twice while
    both live (a prefetched gather, held until its block runs).  The op that raises is told
    to ``where`` (NOTE [unmeasurable step] in where.py)."""

    def __init__(self, where=None):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is compat.c10d_functional.wait_tensor.default:
            return args[0]
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.where is not None:
                self.where.op_failed(func)
            raise


# NOTE [parameter copies]
#     A held storage is a parameter copy when it was made from parameters alone: the output
#     of an op whose every tensor input is a parameter's storage or such a copy (the at-use
#     all-gather of a sharded weight, its ``wait``, the ``cat`` that reorders its shards, its
#     cast to the compute dtype, a transpose).  Anything that mixes in an activation, a buffer
#     or a new tensor is an activation.  These are the analytic plan's "gathered weights"
#     (the output head's gathered copy under fsdp: 2.1 GB per rank for Llama 3 8B in float32),
#     reported on their own row by both methods, so each row means the same thing in both.


class _Made(TorchDispatchMode):
    """Notes the storage of every op output (weakly), to sum what is still alive later,
    and which of them are parameter copies (NOTE [parameter copies])."""

    def __init__(self, params):
        super().__init__()
        self.made: dict[int, StorageWeakRef] = {}
        # the parameters' storages, then what is made of them alone; weakly, so that a storage
        # freed since and its address reused by one made elsewhere (the step's inputs) is not a copy
        self.copies: dict[int, StorageWeakRef] = {}
        for t in params:
            st = _local(t).untyped_storage()
            self.copies[compat.storage_key(st)] = StorageWeakRef(st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [_key(t) for t in compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        copy = bool(ins) and all(self._is_copy(k) for k in ins)
        for t in compat.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = _local(t).untyped_storage()
                key = compat.storage_key(st)
                old = self.made.get(key)
                if old is None or old.expired():  # a storage freed since may have left its address
                    self.made[key] = StorageWeakRef(st)
                    self.copies.pop(key, None)
                if copy:
                    self.copies[key] = StorageWeakRef(st)
        return out

    def _is_copy(self, key: int) -> bool:
        ref = self.copies.get(key)
        return ref is not None and not ref.expired()

    def alive(self, exclude: set[int]) -> tuple[int, int]:
        """Bytes of the noted storages still alive, at their size now, less ``exclude``:
        (activations, parameter copies)."""
        n = [0, 0]
        for key, ref in list(self.made.items()):
            if not ref.expired() and key not in exclude:
                n[self._is_copy(key)] += compat.storage_nbytes_if_alive(ref)
        return n[0], n[1]


def measure(
    build: Build,
    layout,
    mesh_sizes: Mapping[str, int],
    *,
    global_batch: int,
    seq: int,
    grad_accum: int = 1,
    activation_checkpointing: str = "none",
    shard_kw: "Mapping[str, Any] | None" = None,
    offload: Any = None,
    name: str = "model",
) -> Measured:
    """Run two training steps of ``build("meta")`` sharded under ``layout`` on a fake mesh
    of ``mesh_sizes`` and measure the second (NOTE [fake measurement]).  ``global_batch``
    sequences of ``seq`` tokens per step in ``grad_accum`` micro-batches; ``shard_kw`` are
    ``meshlm.shard``'s dtype arguments (``meshlm.layout.precision.shard_dtypes``); ``offload`` an
    OffloadSpec whose tiers the step runs with, on fake tensors
    (NOTE [planned offload] in meshlm/plan/offload.py).  The model's output is read as
    ``meshlm train`` reads it (``meshlm.models.node.loss_of``: the loss, a dict with a
    ``"loss"`` entry, or an output with a ``.loss``); ``name`` labels the model in its errors.
    A step that cannot run on fake tensors is a ConfigError naming the module, the op and
    the model's line (NOTE [unmeasurable step] in where.py)."""
    import torch.distributed as dist

    from meshlm.core import state as run_state
    from meshlm.layout.mesh import make_mesh

    own = not dist.is_initialized()
    if not own and dist.get_backend() != "fake":
        raise ConfigError(
            f"meshlm.plan measures on a fake process group, but this process is in a "
            f"{dist.get_backend()} one: plan before the process group starts (layout=auto is "
            "resolved before launch), or use plan.method=formula"
        )
    saved = run_state.swap(fake_eager=True)  # NOTE [fake eager] in meshlm/core/state.py
    # DTensor warns, per redistribution, about sequential all-reduces over two mesh axes
    # (a gradient Partial over dp and tp): a fact of the layout, not news to a planner's user
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    where = Where()
    try:
        mesh = make_mesh(dict(mesh_sizes), fake=True)
        with compat.dtensor_index_math_outside_fake():

            def run(built: Build) -> Measured:
                return _measure(
                    built,
                    layout,
                    mesh,
                    global_batch // grad_accum,
                    seq,
                    grad_accum,
                    activation_checkpointing,
                    shard_kw,
                    offload,
                    name,
                    where,
                )

            return _counted(build, run, layout, offload)
    except Exception as e:
        # a step that runs for real but not on fake tensors (an op that reads data back to
        # Python): say so in the model's terms, never a raw torch traceback
        err = unmeasurable(e, where, getattr(layout, "name", layout), dict(mesh_sizes))
        if err is None:
            raise
        raise err from None
    finally:
        where.detach()
        run_state.restore(saved)
        log.setLevel(level)
        if own and dist.is_initialized():
            dist.destroy_process_group()  # leave no process group behind (meshlm train starts its own)


def _measure(
    build, layout, mesh, micro, seq, grad_accum, activation_checkpointing, shard_kw, offload, name, where
) -> Measured:
    from torch.utils.flop_counter import FlopCounterMode

    from meshlm.layout.mesh import mesh_spec
    from meshlm.layout.rules import load_layout
    from meshlm.models.node import ModelConfig, loss_of
    from meshlm.plan.moe import expert_summary
    from meshlm.plan.offload import FakeActivations, FakeTier
    from meshlm.plan.scopes import state_by_scope
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.lowering import shard
    from meshlm.runtime.lowering.inputs import shard_batch
    from meshlm.runtime.memory import PeakStorage, model_state_bytes
    from meshlm.runtime.offload.params import ParamOffload
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    label = ModelConfig(target=None, name=name)  # what loss_of's errors call the model
    with compat.fake_tensor_mode(allow_non_fake_inputs=True), _WaitIsIdentity(where):
        model = shard(build("meta"), layout, mesh, init=False, **dict(shard_kw or {}))
        where.attach(model)
        apply_activation_checkpointing(model, activation_checkpointing)
        tier = FakeTier(offload.optimizer) if offload is not None and offload.optimizer != "device" else None
        acts = FakeActivations() if offload is not None and offload.activations != "device" else None
        ptier = FakeTier(offload.params) if offload is not None and offload.params != "device" else None
        poff = ParamOffload(model, ptier, prefetch=False) if ptier is not None else None
        gtier = FakeTier(offload.grads) if offload is not None and offload.grads != "device" else None
        opt = ShardedOptimizer(
            model, torch.optim.AdamW, lr=1e-3, offload=tier, offload_params=poff, offload_grads=gtier
        )
        psi = sum(p.numel() for p in model.parameters())
        lay, scopes = load_layout(layout), {}

        def batch():
            """This rank's tokens, targets and extra inputs of a micro-batch, made in the step
            as train's loader makes them (their storages count in the step's peak)."""
            toks = torch.zeros(micro, seq + 1, dtype=torch.long)
            x, y = shard_batch(toks[:, :-1], layout, mesh), shard_batch(toks[:, 1:], layout, mesh)
            return x, y, _example_inputs(model, micro, seq, layout, mesh)

        moved = [0]  # bytes the first micro-batch's forward moved off the device (offload.activations)
        on_tier = [0]  # bytes of gradients on their tier at the step (offload.grads)

        def step(cc=None, made=None) -> tuple[tuple[int, int], int]:
            """One step as meshlm train runs it; ((held activations, held parameter
            copies), grads after backward)."""
            held = (0, 0)
            for i in range(grad_accum):
                ctx = made if (made is not None and i == 0) else contextlib.nullcontext()
                x, y, extras = batch()
                with acts.context() if acts is not None else contextlib.nullcontext():
                    where.phase = "forward"
                    with ctx, cc.phase("forward") if cc is not None else contextlib.nullcontext():
                        # as train reads it: the output's other entries (a dict's logits) die here
                        loss = loss_of(model(x, y, **extras), label)
                    if made is not None and i == 0:
                        inputs = {_key(x), _key(y), *(_key(v) for v in extras.values())}
                        held = made.alive(set(_nbytes(model.parameters())) | inputs | {_key(loss)})
                        moved[0] = acts.out_bytes if acts is not None else 0
                    where.phase = "backward"
                    (loss / grad_accum).backward()
            grads = model_state_bytes(model, opt)["grads"]
            before = state_by_scope(model, opt, lay) if lay.scopes else {}
            where.phase = "the optimizer step"
            with cc.phase("optimizer") if cc is not None else contextlib.nullcontext():
                opt.step()
            # ZeRO-1 releases main gradients as the step reduces them into the masters'
            # (NOTE [main grads] in main_grad.py): whichever point holds more
            grads = max(grads, model_state_bytes(model, opt)["grads"])
            if lay.scopes:  # the same per scope (NOTE [planned scopes] in plan/scopes.py)
                scopes.update(state_by_scope(model, opt, lay))
                for k, v in before.items():
                    scopes[k]["grads"] = max(v["grads"], scopes[k]["grads"])
            if gtier is not None:
                on_tier[0] = sum(t.numel() * t.element_size() for t in opt.grad_offload.held)
            opt.zero_grad()
            return held, grads

        # FLOPs in the first step (the same ops): FlopCounterMode keeps module hooks whose
        # references would hold a checkpointed block's recompute and raise the peak.
        flops = FlopCounterMode(display=False)
        with flops:
            step()
        if acts is not None:
            acts.out_bytes = acts.in_bytes = 0
        for t in (tier, ptier, gtier):
            if t is not None:
                t.bytes_in = t.bytes_out = 0
        seed = (
            list(model.parameters())
            + list(opt.masters().values())
            + [v for s in opt.inner.state.values() for v in s.values() if torch.is_tensor(v)]
        )
        cc, made = CommCounter(mesh), _Made(model.parameters())
        peak = PeakStorage(seed)
        with cc, peak:
            held, grads = step(cc, made)
        state = model_state_bytes(model, opt)
        dtype = dict(shard_kw or {}).get("compute_dtype") or dict(shard_kw or {}).get("param_dtype")
        moe = expert_summary(model, lay.compute, mesh_spec(mesh).as_dict(), micro, seq, dtype)
    kinds = {}
    if tier is not None and tier.tier == "host":  # stepped on the host (NOTE [host step]): by its parameters
        from meshlm.runtime.offload.host_step import planned

        extra, up, down = planned(opt)
        kinds["optimizer"] = {"bytes": opt.offload.nbytes() + extra, "in_bytes": up, "out_bytes": down}
    elif tier is not None:  # what moves (NOTE [offloaded step]) and what moved in the measured step
        kinds["optimizer"] = {"bytes": opt.offload.nbytes(), "in_bytes": tier.bytes_in, "out_bytes": tier.bytes_out}
    if ptier is not None:  # every block's parameters; the measured peak holds one block's, no read-ahead
        nbytes = sum(t.numel() * t.element_size() for g in poff.groups for t in g)
        kinds["params"] = {"bytes": nbytes, "in_bytes": ptier.bytes_in, "out_bytes": ptier.bytes_out}
    if gtier is not None:  # every gradient as accumulated, and ZeRO-1's shards; the peak holds what the hook holds
        kinds["grads"] = {"bytes": on_tier[0], "in_bytes": gtier.bytes_in, "out_bytes": gtier.bytes_out}
    if acts is not None:
        kinds["activations"] = {"bytes": moved[0], "in_bytes": acts.in_bytes, "out_bytes": acts.out_bytes}
    memory = {
        "params": state["params"],
        "grads": grads,
        "optimizer": state["optimizer"],
        "activations": held[0],
        "gathered": held[1],
        "peak": peak.peak,
    }
    comm: dict[tuple, dict[str, float]] = {}
    for r in cc.records:
        e = comm.setdefault((r.kind, r.axes, r.phase), {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        e["count"] += 1
        e["bytes"] += r.bytes
        e["wire_bytes"] += r.wire_bytes
    return Measured(memory, comm, int(flops.get_total_flops()), psi, kinds, scopes, moe)


def _counted(build: Build, run: Callable[[Build], Measured], layout, offload) -> Measured:
    """``run(build)``, or, for a model with long lists of identical blocks, the figures of
    a few blocks measured and the rest counted (NOTE [counted blocks] in repeats.py)."""
    from meshlm.layout.rules import is_pipelined, load_layout
    from meshlm.plan.repeats import count, cut, repeats
    from meshlm.plan.where import _fake_cause

    lay = load_layout(layout)
    if is_pipelined(lay) or lay.scopes or offload is not None:
        return run(build)
    from meshlm.core.moe import MoE

    with compat.fake_tensor_mode(allow_non_fake_inputs=True):
        whole = build("meta")
        lists = repeats(whole)
        psi = sum(p.numel() for p in whole.parameters())
        experts = any(isinstance(m, MoE) for m in whole.modules())
    del whole
    if not lists or experts:  # a mixture of experts' figures are read off the whole model (plan/moe.py)
        return run(build)
    two = {r.path: 2 for r in lists}
    try:
        base = run(cut(build, two))
        more = [(run(cut(build, {**two, r.path: 3})), r.n - 2) for r in lists]
    except Exception as e:  # a model whose forward needs every block (it counts them): measure it whole
        if _fake_cause(e) is not None:
            raise  # the whole model cannot run it either (NOTE [unmeasurable step] in where.py)
        return run(build)
    fig = count(
        {"memory": base.memory, "comm": base.comm, "flops": base.flops},
        [({"memory": m.memory, "comm": m.comm, "flops": m.flops}, k) for m, k in more],
    )
    comm = {key: {f: v[f] for f in ("count", "bytes", "wire_bytes")} for key, v in fig["comm"].items() if v["count"]}
    return Measured({k: int(v) for k, v in fig["memory"].items()}, comm, int(fig["flops"]), psi)


def _example_inputs(model, batch: int, seq: int, layout, mesh) -> dict:
    """The model's keyword inputs besides tokens and labels for a step of ``batch`` rows
    (its ``example_inputs(batch, seq)``, e.g. a vision-language model's images), each
    rank's slice; {} for a model that takes none."""
    from meshlm.runtime.lowering import input_axes
    from meshlm.runtime.lowering.inputs import shard_batch

    make = getattr(model, "example_inputs", None)
    if make is None:
        return {}
    return {k: shard_batch(v, layout, mesh, input_axes(model, k, v.ndim)) for k, v in make(batch, seq).items()}
