"""``plan``: the analytic planner for our Llama (one layer planned, counted ``layers``
times; NOTE [one layer] in state.py): model state from the lowering's plans, activations
from the formula, collectives from the comm model.  Plans Llama 3 405B on 16,384 ranks in
milliseconds; the measured planner (measure.py) is held to it in tests."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from meshlm.core.errors import ConfigError
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.offload import OffloadSpec
from meshlm.layout.precision import default_reduce_dtype, train_dtypes
from meshlm.layout.rules import Layout, load_layout
from meshlm.models import LlamaConfig
from meshlm.plan import offload as _offload
from meshlm.plan.activations import activation_bytes
from meshlm.plan.comm_model import _comm, _comm_formula
from meshlm.plan.report import Plan, _bytes, _dtype, _name
from meshlm.plan.state import (
    _batch_axes,
    _held_gathered,
    _local_numel,
    _master_is_view,
    _param_plans,
    _prod,
    _regathers,
    _shard_n,
    _zero_formula,
    model_config,
)


def plan(
    model: "str | LlamaConfig",
    layout: "str | Layout",
    mesh: "Mapping[str, int] | str | MeshSpec",
    *,
    global_batch: int,
    seq: int,
    activation_checkpointing: str = "none",
    param_dtype: "str | torch.dtype" = "float32",
    master_dtype: "str | torch.dtype | None" = None,
    grad_accum: int = 1,
    compute_dtype: str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    offload: "OffloadSpec | Mapping[str, Any] | None" = None,
    device_is_host: bool = False,
) -> Plan:
    """Predict per-rank memory and per-step communication (see the module docstring).

    ``global_batch`` sequences per optimizer step over all ranks, in ``grad_accum``
    micro-batches; activations are per micro-batch.  ``activation_checkpointing`` is
    ``none``, ``selective`` or ``full`` (``train.activation_checkpointing``).  The dtypes
    are ``meshlm.shard``'s and ``ShardedOptimizer``'s: ``param_dtype`` the storage,
    ``compute_dtype`` the parameters at use and the activations (None: the storage),
    ``reduce_dtype`` the gradient reductions (None: as ``shard``, float32 under a narrower
    compute or storage dtype), ``master_dtype`` the optimizer's (None: the storage).
    ``param_dtype="auto"`` is what ``meshlm train`` chooses for this layout and mesh
    (``precision.train_dtypes``, NOTE [mixed precision] in meshlm/layout/precision.py;
    :func:`meshlm.app.plan.from_run_config`): float32 storage used in ``compute_dtype``, or for ZeRO-1/2
    under a narrower ``compute_dtype`` storage in it with float32 main gradients (NOTE
    [main grads] in meshlm/runtime/main_grad.py) and a float32 master.  ``offload``: the tiers
    (an OffloadSpec, or the run's ``offload.*`` settings over the layout's section; None:
    the layout's section): ``memory`` is then the device's and ``offload``/``tiers`` hold the
    rest (NOTE [planned offload] in meshlm/plan/offload.py; ``device_is_host``: the device
    is host memory, which the report notes)."""
    name, cfg = model_config(model)
    lay = load_layout(layout)
    if lay.scopes:
        raise ConfigError(
            f"layout {lay.name} has scopes, which the formula planner (the shipped Llama only) does not model; "
            "plan it with plan.method=measure (NOTE [scoped layouts] in meshlm/core/scopes.py)"
        )
    spec = MeshSpec.parse(mesh)
    sizes = {a: s for a, s in spec.axes}
    if activation_checkpointing not in ("none", "selective", "full"):
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: choose none, selective or full")
    params_ = _param_plans(cfg, lay, sizes)
    tiers = _offload.offload_spec_for(lay, offload)
    gdt = None  # main gradients' dtype (NOTE [main grads] in main_grad.py), None: none
    if param_dtype == "auto":
        td = train_dtypes(_dtype(compute_dtype), _dtype(reduce_dtype) if reduce_dtype else None, lay, sizes)
        param_dtype, compute_dtype, reduce_dtype = (
            td["param_dtype"] or "float32",
            td["compute_dtype"],
            td["reduce_dtype"],
        )
        gdt = td["grad_dtype"]
    pdt = _dtype(param_dtype)
    gdt = gdt if gdt != pdt else None
    mdt = _dtype(master_dtype, gdt or pdt)
    cdt = _dtype(compute_dtype, pdt)
    rdt = _dtype(reduce_dtype, default_reduce_dtype(cdt, [pdt]) or pdt)
    B, MB = _bytes(pdt), _bytes(mdt)
    GB = _bytes(gdt) if gdt is not None else B  # gradients as accumulated
    CB, RB = _bytes(cdt), _bytes(rdt)
    batch_axes = _batch_axes(lay, sizes)
    n_batch = _prod(batch_axes, sizes) * grad_accum
    if global_batch % n_batch:
        raise ConfigError(
            f"train.batch_size={global_batch} does not split into {grad_accum} micro-batch(es) over "
            f"the batch axes {batch_axes or ['-']} of mesh {dict(sizes)} ({n_batch} shards): "
            f"use a train.batch_size that is a multiple of {n_batch}"
        )

    # ---------------------------------------------------------------- model state
    params = grads = optim = moved = 0  # moved: what offload.optimizer moves (NOTE [planned offload])
    host_extra = host_up = host_down = 0  # offload.optimizer=host's step on the host (NOTE [host step])
    master_grads = 0  # of ``grads``: the masters' gradients that are buffers of their own
    main_shards = 0  # ZeRO-1's reduce-scattered main gradients (not held whole: only offload moves them)
    grad_one = 0  # the largest parameter's gradient as accumulated (offload.grads keeps two of them)
    in_blocks = one_block = 0  # stored bytes of the blocks' parameters: what offload.params moves
    for prm in params_:
        pp, k = prm.plan, prm.count
        n_store = _local_numel(pp, pp.storage, sizes)
        n_opt = _local_numel(pp, pp.optimizer, sizes)
        params += k * n_store * B
        if prm.in_block:
            in_blocks += k * n_store * B
            one_block += n_store * B
        gplan = pp.grads if pp.grads is not None else pp.storage  # ZeRO-1: whole local grads
        grads += k * _local_numel(pp, gplan, sizes) * GB
        grad_one = max(grad_one, _local_numel(pp, gplan, sizes) * GB)
        direct = pp.optimizer == pp.storage and pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt
        if prm.in_block and not direct and tiers.params != "device":
            raise ConfigError(
                f"offload.params={tiers.params}: layout {lay.name} keeps optimizer copies of the blocks' parameters "
                "(ZeRO-1/2 masters, or float32 masters of lower-precision storage), which offloaded parameters "
                "cannot be refreshed from chunk by chunk; use a layout that updates parameters in place (ddp, "
                "fsdp, hsdp, tp, fsdp_tp, ...) or offload.optimizer only"
            )
        # AdamW: exp_avg + exp_avg_sq in the master dtype, a float32 `step` scalar
        optim += k * (2 * n_opt * MB + 4)
        moved += k * 2 * n_opt * MB
        own = not direct and not (mdt == pdt and _master_is_view(pp, sizes))
        host_extra += k * n_opt * MB * (1 if own else 2)  # a host master unless its own, a gradient buffer
        host_up += k * n_opt * B
        host_down += k * n_opt * MB
        if not direct:
            if own:
                optim += k * n_opt * MB  # the master copy
                moved += k * n_opt * MB
            # the master's gradient is a new buffer unless the grad already is in optimizer
            # placements and dtype (ZeRO-2 in fp32: the same tensor), or main gradients
            # become it (ZeRO-2: the same tensor; ZeRO-1: each chunk's main gradients are
            # released as it is reduce-scattered, so the shards never add to their peak)
            if not (pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt) and gdt is None:
                grads += k * n_opt * MB
                master_grads += k * n_opt * MB
            elif gdt is not None and pp.grads != pp.optimizer:
                # ZeRO-1's main gradients are reduce-scattered chunk by chunk at the step; with
                # offload.grads the shards go to the tier as buffers of their own
                main_shards += k * n_opt * MB

    psi = cfg.num_params()
    t = sizes.get("tp", 1)
    formulas: dict[str, Any] = {
        "psi": psi,
        "zero": _zero_formula(lay, psi, _shard_n(lay, sizes), t, B, MB, GB if gdt is not None else None),
    }

    # ---------------------------------------------------------------- activations
    b_local = global_batch // n_batch
    regather = any(prm.in_block and _regathers(prm.plan, sizes) for prm in params_)
    act = activation_bytes(cfg, lay, sizes, b_local, seq, activation_checkpointing, cdt)
    gathered = _held_gathered(params_, sizes, regather, CB, cdt != pdt)
    formulas["activations"] = act
    memory = {
        "params": params,
        "grads": grads,
        "optimizer": optim,
        "activations": act["held"],
        "gathered": gathered,
        "recompute": act["recompute"],
    }
    memory["total"] = sum(memory.values())
    blocks_gathered = _held_gathered([q for q in params_ if q.in_block], sizes, regather, CB, cdt != pdt)
    kinds = _offload.analytic(
        tiers,
        memory,
        moved,
        act,
        blocks_gathered,
        grad_accum,
        (in_blocks, one_block),
        (grads - master_grads, master_grads + main_shards, grad_one),
        (host_extra, host_up, host_down),
    )

    # Activation collectives re-run in backward: only under train.activation_checkpointing
    # (whose recompute re-runs them); otherwise a block that re-gathers by checkpointing
    # (compiled) saves their outputs (lowering/policies.py SAVED_COLLECTIVES).
    comm = _comm(
        cfg, lay, sizes, params_, b_local, seq, (B, CB, RB, MB), batch_axes, grad_accum, activation_checkpointing
    )
    formulas["comm"] = _comm_formula(lay, cfg, psi, sizes, b_local, seq, (B, CB, RB), batch_axes)
    p = Plan(
        name,
        lay.name,
        dict(sizes),
        spec.size,
        global_batch,
        seq,
        _name(pdt),
        _name(mdt),
        activation_checkpointing,
        memory,
        formulas,
        comm,
        _name(cdt),
        _name(rdt),
    )
    return _offload.finish(p, tiers, kinds, device_is_host)
