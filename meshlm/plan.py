"""``meshlm plan``: per-rank memory and communication of a model under a layout and mesh,
without the hardware, and automatic layout choice under a memory limit.

Everything is computed analytically from the per-parameter plans of
``meshlm.lower.plan_params`` on a meta-device model (no tracing, no process group), so
Llama 3 405B on 16,384 ranks plans in seconds.  Each figure sits beside its textbook
formula (README, shipped layouts): ZeRO model-state memory, DDP/ZeRO/Megatron communication volume,
and the activation formula re-derived for our Llama block (docs/plan.md).

NOTE [plan = lowering]
    The predictions mirror what ``meshlm.shard`` + ``ShardedOptimizer`` do, parameter by
    parameter: storage/grads/optimizer placements give the memory; the difference between
    storage and compute placements gives the at-use all-gathers (again in backward for a
    block whose parameters are gathered over a data axis: NOTE [re-gather in backward] in
    lower.py); the data axes that split the batch give the gradient reductions (a
    reduce-scatter where the grads placement shards over the axis, else an all-reduce, in
    mesh order).  tests/dist/test_plan_exact.py holds the two to equality on real gloo runs.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from meshlm.axes import DATA_AXES
from meshlm.comm import ring_factor
from meshlm.errors import ConfigError, MeshlmError
from meshlm.layout import Layout, load_layout, shipped_layouts
from meshlm.lower import ParamPlan, _pure_data_parallel, plan_params
from meshlm.mesh import MeshSpec
from meshlm.models import Llama, LlamaConfig, llama_config
from meshlm.optim import outside_chunks
from meshlm.precision import default_reduce_dtype, train_dtypes

SCHEMA_VERSION = 1
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(d: "str | torch.dtype | None", default: torch.dtype = torch.float32) -> torch.dtype:
    if d is None:
        return default
    return d if isinstance(d, torch.dtype) else _DTYPES[d]


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _bytes(d: torch.dtype) -> int:
    return torch.empty((), dtype=d).element_size()


# --------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """A named hardware profile for the cost model (docs/plan.md)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    mfu: float  # fraction of peak a well-tuned step reaches
    intra_bw: float  # bytes/s per device, within a node (NVLink)
    inter_bw: float  # bytes/s per device, across nodes (InfiniBand)
    node_size: int  # devices per node
    memory: float  # bytes per device


GiB = 1024**3
HARDWARE = {
    "h100_nvlink_ib": Hardware("h100_nvlink_ib", 989e12, 0.40, 450e9, 50e9, 8, 80 * GiB),
    "h200_nvlink_ib": Hardware("h200_nvlink_ib", 989e12, 0.40, 450e9, 50e9, 8, 141 * GiB),
    "cpu": Hardware("cpu", 1e11, 0.5, 5e9, 1e9, 1, 24 * GiB),
}


# --------------------------------------------------------------------------- report
@dataclass
class CommEntry:
    kind: str
    axes: tuple[str, ...]
    phase: str
    count: int
    bytes: int  # logical bytes per rank (NOTE [logical bytes] in comm.py)
    wire_bytes: float
    what: str  # which part of the design issues it


@dataclass
class Plan:
    """Per-rank prediction for one (model, layout, mesh, batch, seq) point."""

    model: str
    layout: str
    mesh: dict[str, int]
    world_size: int
    global_batch: int
    seq: int
    param_dtype: str  # storage
    master_dtype: str
    activation_checkpointing: str
    memory: dict[str, int]  # params, grads, optimizer, activations, total (bytes per rank)
    formulas: dict[str, Any]  # textbook figure beside each predicted number
    comm: list[CommEntry] = field(default_factory=list)
    compute_dtype: str = "float32"  # parameters at use, activations
    reduce_dtype: str = "float32"  # gradient reductions

    def comm_summary(self, by_phase: bool = False) -> dict[tuple, dict[str, float]]:
        out: dict[tuple, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        for c in self.comm:
            key = (c.kind, c.axes, c.phase) if by_phase else (c.kind, c.axes)
            out[key]["count"] += c.count
            out[key]["bytes"] += c.bytes
            out[key]["wire_bytes"] += c.wire_bytes
        return dict(out)

    def comm_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.comm)

    def to_json(self) -> dict:
        d = asdict(self)
        d["schema"] = SCHEMA_VERSION
        d["comm"] = [dict(asdict(c), axes=list(c.axes)) for c in self.comm]
        d["comm_wire_bytes_total"] = self.comm_bytes()
        return d


# --------------------------------------------------------------------------- core
def _local_numel(pp: ParamPlan, plan, sizes: Mapping[str, int]) -> int:
    return math.prod(pp.local_shape(plan, sizes))


def _prod(axes, sizes) -> int:
    return math.prod(sizes.get(a, 1) for a in axes)


def _master_is_view(pp: ParamPlan, sizes: Mapping[str, int]) -> bool:
    """A same-dtype master is a view of the parameter (optim.py ``_shard_view``) when the
    optimizer placements only split further what storage keeps: per tensor dim, the
    storage's active axes are the leading ones of the optimizer's, and no axis moves to
    another dim."""
    def active(plan):
        return [tuple(a for a in axes if sizes.get(a, 1) > 1) for axes in plan]

    st, op = active(pp.storage), active(pp.optimizer)
    dim_of = {a: d for d, axes in enumerate(op) for a in axes}
    return all(s == o[:len(s)] for s, o in zip(st, op)) and all(dim_of.get(a, d) == d for d, axes in enumerate(st)
                                                                 for a in axes)


def _dimplan_axes(plan) -> set[str]:
    return {a for axes in plan for a in axes}


def model_config(model: "str | LlamaConfig | tuple[str, LlamaConfig]") -> tuple[str, LlamaConfig]:
    """(name, config) from a config name, a LlamaConfig, or a (name, LlamaConfig) pair."""
    if isinstance(model, tuple):
        return model
    if isinstance(model, LlamaConfig):
        return "custom", model
    return model, llama_config(model)


_PLAN_CACHE: dict = {}
_MODELS: dict = {}  # one one-layer meta model per config


@dataclass(frozen=True)
class _Param:
    """One parameter's plan and how many identical copies the model holds (every layer's
    parameters are planned once, on layer 0, and counted ``L`` times)."""

    plan: ParamPlan
    count: int
    in_block: bool
    name: str  # the FQN with ``layers.<i>.`` removed


def _param_plans(cfg: LlamaConfig, layout: Layout, sizes: dict[str, int]) -> list[_Param]:
    """Per-parameter plans, each distinct parameter planned once.

    NOTE [one layer]: every block of our Llama has the same parameters (names, shapes,
    axes), so planning layer 0 of a one-layer model and counting it ``layers`` times gives
    the plans of the whole model; planning cost is independent of depth."""
    key = (cfg, layout.source, layout.name, tuple(sorted(sizes.items())))
    if key not in _PLAN_CACHE:
        one = replace(cfg, layers=1)
        if one not in _MODELS:
            _MODELS[one] = Llama(one, device="meta")
        out = []
        for fqn, pp in plan_params(_MODELS[one], layout, sizes).items():
            in_block = fqn.startswith("layers.")
            out.append(_Param(pp, cfg.layers if in_block else 1, in_block,
                              fqn.split(".", 2)[2] if in_block else fqn))
        if len(_PLAN_CACHE) > 4096:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = out
    return _PLAN_CACHE[key]


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
    (``precision.train_dtypes``, NOTE [mixed precision] in meshlm/precision.py;
    :func:`_from_run_config`): float32 storage used in ``compute_dtype``, or for ZeRO-1/2
    under a narrower ``compute_dtype`` storage in it with float32 main gradients (NOTE
    [main grads] in meshlm/main_grad.py) and a float32 master."""
    name, cfg = model_config(model)
    lay = load_layout(layout)
    spec = MeshSpec.parse(mesh)
    sizes = {a: s for a, s in spec.axes}
    if activation_checkpointing not in ("none", "selective", "full"):
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: choose none, selective or full")
    params_ = _param_plans(cfg, lay, sizes)
    gdt = None  # main gradients' dtype (NOTE [main grads] in main_grad.py), None: none
    if param_dtype == "auto":
        td = train_dtypes(_dtype(compute_dtype), _dtype(reduce_dtype) if reduce_dtype else None, lay, sizes)
        param_dtype, compute_dtype, reduce_dtype = td["param_dtype"] or "float32", td["compute_dtype"], td["reduce_dtype"]
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
        raise ConfigError(f"train.batch_size={global_batch} does not split into {grad_accum} micro-batch(es) over "
                          f"the batch axes {batch_axes or ['-']} of mesh {dict(sizes)} ({n_batch} shards): "
                          f"use a train.batch_size that is a multiple of {n_batch}")

    # ---------------------------------------------------------------- model state
    params = grads = optim = 0
    for prm in params_:
        pp, k = prm.plan, prm.count
        n_store = _local_numel(pp, pp.storage, sizes)
        n_opt = _local_numel(pp, pp.optimizer, sizes)
        params += k * n_store * B
        gplan = pp.grads if pp.grads is not None else pp.storage  # ZeRO-1: whole local grads
        grads += k * _local_numel(pp, gplan, sizes) * GB
        direct = pp.optimizer == pp.storage and pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt
        # AdamW: exp_avg + exp_avg_sq in the master dtype, a float32 `step` scalar
        optim += k * (2 * n_opt * MB + 4)
        if not direct:
            if not (mdt == pdt and _master_is_view(pp, sizes)):
                optim += k * n_opt * MB  # the master copy
            # the master's gradient is a new buffer unless the grad already is in optimizer
            # placements and dtype (ZeRO-2 in fp32: the same tensor), or main gradients
            # become it (ZeRO-2: the same tensor; ZeRO-1: each chunk's main gradients are
            # released as it is reduce-scattered, so the shards never add to their peak)
            if not (pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt) and gdt is None:
                grads += k * n_opt * MB

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
    memory = {"params": params, "grads": grads, "optimizer": optim, "activations": act["held"],
              "gathered": gathered, "recompute": act["recompute"]}
    memory["total"] = sum(memory.values())

    # Activation collectives re-run in backward: only under train.activation_checkpointing
    # (whose recompute re-runs them); otherwise a block that re-gathers by checkpointing
    # (compiled) saves their outputs (lower.py _SAVED_COLLECTIVES).
    ckpt = activation_checkpointing != "none"
    comm = _comm(cfg, lay, sizes, params_, b_local, seq, (B, CB, RB, MB), batch_axes, grad_accum, ckpt)
    formulas["comm"] = _comm_formula(lay, cfg, psi, sizes, b_local, seq, (B, CB, RB), batch_axes)
    return Plan(name, lay.name, dict(sizes), spec.size, global_batch, seq, _name(pdt), _name(mdt),
                activation_checkpointing, memory, formulas, comm, _name(cdt), _name(rdt))


def _regathers(pp: ParamPlan, sizes: Mapping[str, int]) -> bool:
    """Gathered over a data axis at use (lower.py ``_needs_regather``, on active axes)."""
    return any(a in DATA_AXES and a not in c and sizes.get(a, 1) > 1 for s_, c in zip(pp.storage, pp.compute) for a in s_)


def _held_gathered(params_: list[_Param], sizes: Mapping[str, int], regather: bool, B: int, cast: bool) -> int:
    """Bytes of at-use copies of parameters that autograd keeps from forward to backward.

    A parameter whose compute placements differ from its storage, or every parameter when
    ``cast`` (the compute dtype differs from the storage's), is redistributed or cast (a
    new tensor of ``B`` bytes per element) at use, and ``F.linear``/the norm's multiply save
    that copy for backward.  Block
    parameters gathered over a data axis are not kept (NOTE [re-gather in backward]); the
    embedding table is not kept either (``F.embedding`` saves only the token ids), unless it
    is tied to the output head."""
    out = 0
    for prm in params_:
        pp = prm.plan
        if not cast and [[a for a in d if sizes.get(a, 1) > 1] for d in pp.compute] == \
                [[a for a in d if sizes.get(a, 1) > 1] for d in pp.storage]:
            continue  # used as stored: the saved tensor is (a view of) the parameter
        if prm.in_block and regather:
            continue
        if prm.name == "tok_emb" and any(p.name == "lm_head" for p in params_):
            continue
        out += prm.count * _local_numel(pp, pp.compute, sizes) * B
    return out


def _shard_n(lay: Layout, sizes: Mapping[str, int]) -> int:
    """Ranks the model state is sharded over on the data axes (ZeRO's N)."""
    rules = lay.optimizer_rules
    axes = {a for v in rules.values() for a in v if a in DATA_AXES and sizes.get(a, 1) > 1}
    return _prod(sorted(axes), sizes)


def _batch_axes(lay: Layout, sizes: Mapping[str, int]) -> list[str]:
    return [a for a in lay.compute.get("batch", ()) if sizes.get(a, 1) > 1]


def _zero_formula(lay: Layout, psi: int, n: int, t: int, B: int, MB: int, GB: Optional[int] = None) -> dict[str, Any]:
    """ZeRO-paper model-state bytes per rank for this layout's stage, TP dividing by t.
    (Uses Ψ of the whole model; replicated norms make the exact figure a little larger.)
    ``GB``: main gradients of that many bytes (NOTE [main grads]), None: none."""
    stage = {"zero1": 1, "zero2": 2}.get(lay.name)
    if stage is None:
        stage = 3 if any(a in DATA_AXES for v in lay.params.values() for a in v) else 0
    nn_ = max(n if stage else 1, 1)
    # hsdp shards over fsdp only
    p = psi / t
    params = p * B / (nn_ if stage == 3 else 1)
    if GB is not None:  # main gradients become the master's: no second buffer
        grads = p * GB / (nn_ if stage >= 2 else 1)
    else:
        grads = p * B / (nn_ if stage >= 2 else 1) + (p * MB / nn_ if MB != B else 0)  # + the master's grad
    opt = p * (2 * MB) / (nn_ if stage >= 1 else 1) + (p * MB / nn_ if (stage in (1, 2) or MB != B) else 0)
    gtext = (f"main grads {GB}Ψ/{'N' if stage >= 2 else '1'}" if GB is not None else
             f"grads {B}Ψ/{'N' if stage >= 2 else '1'}{f' + master grads {MB}Ψ/N' if MB != B else ''}")
    return {"stage": stage, "params": params, "grads": grads, "optimizer": opt,
            "text": f"ZeRO-{stage}: params {B}Ψ/{'N' if stage == 3 else '1'}, {gtext}, "
                    f"Adam {2 * MB}Ψ/{'N' if stage >= 1 else '1'} (+ master {MB}Ψ/N if separate), Ψ/t with t={t}"}


# --------------------------------------------------------------------------- activations
def activation_bytes(cfg: LlamaConfig, lay: Layout, sizes: Mapping[str, int], b: int, s: int,
                     ac: str, dtype: torch.dtype) -> dict[str, Any]:
    """Activation bytes per rank per micro-batch (docs/plan.md, "Activations").

    ``held``: what stays allocated from the end of forward to the start of backward (what
    autograd and checkpointing keep).  ``recompute``: the transient extra while backward
    recomputes one checkpointed block.  Per token of one block, in bytes, with B the
    compute dtype's size, F = 4 (float32), t the tp degree of heads/kv_heads/mlp, ts of seq:

      RMSNorm (x2):  F·h/ts (its float32 input)  + F/ts (rsqrt)  + B·h/ts (normalised x,
                     kept for the weight's gradient) + B·h (its output as the matmuls see
                     it: whole seq, gathered over ts under sequence parallelism)
      attention:     B·(q + k' + v' + o)/t  +  F·a/t (logsumexp)   (q after RoPE, k' and v'
                     as SDPA sees them: expanded to all heads under GQA, so q each, else kv;
                     o the SDPA output, which the o-projection's view reuses)
      MLP:           4·B·f/t  (gate, silu(gate), up, silu·up)
      RoPE tables:   4·s·hd·B per layer (cos and sin, concatenated, for q and for k)

    Outside blocks: the final norm (as above) and the float32 log-softmax of the logits
    (F·V/tv per token), plus the loss's 4-byte total weight.

    ``selective`` blocks keep only the block input (B·h/ts) and the matmul and attention
    outputs: B·(q + 2kv + o)/t + F·a/t + B·h (o-projection output, whole seq, before its
    reduction) + 2·B·f/t (gate, up) + B·h (down-projection output).  ``full`` keeps the
    block input only.  Blocks whose parameters are re-gathered (ZeRO-3) add no checkpoint of
    their own in eager mode: they free their gathered parameters after forward and gather
    them again in backward (NOTE [free and re-gather] in bucket.py), so without
    ``train.activation_checkpointing`` they hold what an unchecked block holds, and with it
    what train's checkpoint keeps."""
    h, hd = cfg.embed, cfg.hd
    q, kv, f, a, V, L = cfg.heads * hd, cfg.kv_heads * hd, cfg.mlp, cfg.heads, cfg.vocab, cfg.layers
    t = _prod([x for x in lay.compute.get("heads", ()) if sizes.get(x, 1) > 1], sizes)
    tf = _prod([x for x in lay.compute.get("mlp", ()) if sizes.get(x, 1) > 1], sizes)
    tv = _prod([x for x in lay.compute.get("vocab", ()) if sizes.get(x, 1) > 1], sizes)
    ts = _prod([x for x in lay.compute.get("seq", ()) if sizes.get(x, 1) > 1], sizes)
    B, F = _bytes(dtype), 4
    tok = b * s
    norm = F * h / ts + F / ts + B * h / ts + B * h
    kv_sdpa = q if cfg.heads != cfg.kv_heads else kv
    attn = B * (2 * q + 2 * kv_sdpa) / t + F * a / t
    mlp = 4 * B * f / tf
    rope = 4 * s * hd * B
    full_block = tok * (2 * norm + attn + mlp) + rope
    saved_block = tok * (B * h / ts + B * (2 * q + 2 * kv) / t + F * a / t + 2 * B * h + 2 * B * f / tf)
    input_block = tok * B * h / ts
    outside = tok * (norm + F * V / tv) + 4
    if ac == "full":
        per_block, mode = input_block, "full"
    elif ac == "selective":
        per_block, mode = saved_block, "selective"
    else:
        per_block, mode = full_block, "none"
    held = per_block * L + outside
    recompute = max(full_block - per_block, 0) if mode != "none" else 0
    text = {"none": "per layer sb·(2·[(F+B)h/ts + F/ts + Bh] + B(2q+2k')/t + F·a/t + 4B·f/t) + 4s·hd·B",
            "selective": "per layer sb·(Bh/ts + B(2q+2kv)/t + F·a/t + 2Bh + 2B·f/t) (matmul/SDPA outputs)",
            "full": "per layer sb·B·h/ts (block input)"}[mode]
    # Korthikanti et al. (GPT block, 16-bit, bytes per layer) for the same regime, for scale.
    sbh = s * b * h
    if mode == "full":
        korthikanti = 2 * sbh / ts
    elif mode == "selective":
        korthikanti = 34 * sbh / ts if (t == 1 or ts > 1) else sbh * (10 + 24 / t)
    else:
        korthikanti = sbh * (34 + 5 * a * s / h) if t == 1 else (
            sbh * (10 + 24 / t + 5 * a * s / (h * t)) if ts == 1 else sbh * (34 / t + 5 * a * s / (h * t)))
    return {"held": int(held), "recompute": int(recompute), "layers": L, "per_layer": per_block, "outside_blocks": outside,
            "checkpointing": mode, "text": text + f", q={q}, kv={kv}, f={f}, t={t}, ts={ts}",
            "korthikanti_gpt_16bit_per_layer": korthikanti}

# --------------------------------------------------------------------------- communication
def _comm(cfg, lay, sizes, params_, b, s, nbytes, batch_axes, accum, ckpt) -> list[CommEntry]:
    """``nbytes``: element bytes of the storage, compute, reduce and master dtypes: gathers
    move the compute dtype (cast before the gather), gradient reductions the reduce dtype
    (the master's at the optimizer step, ZeRO-1), the optimizer's all-gather the storage."""
    B, CB, RB, MB = nbytes
    mixed = MB != B
    out: dict[tuple, CommEntry] = {}
    flat: set[tuple] = set()

    def add(kind, axis, phase, nbytes, what, count=1, bucket=None):
        """``bucket``: the parameter is in a block's bucket (NOTE [block buckets] in
        bucket.py), and ``bucket`` names its flat collective: every parameter with the same
        one shares a single collective per block, so only the first counts it (``count``
        times, once per block)."""
        n = sizes[axis]
        key = (kind, (axis,), phase, what)
        e = out.get(key)
        if e is None:
            e = out[key] = CommEntry(kind, (axis,), phase, 0, 0, 0.0, what)
        if bucket is None or (key, bucket) not in flat:
            e.count += count
            if bucket is not None:
                flat.add((key, bucket))
        e.bytes += int(nbytes) * count
        e.wire_bytes += nbytes * ring_factor(kind, n) * count

    data_batch = [a for a in batch_axes if a in DATA_AXES]
    data_active = [a for a in DATA_AXES if sizes.get(a, 1) > 1]
    # NOTE [local root] in root.py: under pure data parallelism the root runs on local
    # tensors; its parameters that compute uses as stored share one flat gradient
    # reduction, and the loss is combined from (loss x weight, weight).
    local_root = bool(data_active) and _pure_data_parallel(lay, sizes)
    outside = _outside_chunks(params_)
    seq_axes = [a for a in lay.compute.get("seq", ()) if sizes.get(a, 1) > 1]
    for prm in params_:
        pp, k = prm.plan, prm.count
        # at-use gather: storage axes that compute drops, inner axis first
        cur = _local_numel(pp, pp.storage, sizes)
        gathers = []
        for st_axes, cp_axes in zip(pp.storage, pp.compute):
            for ax in reversed(st_axes):
                if ax not in cp_axes and sizes.get(ax, 1) > 1:
                    cur *= sizes[ax]
                    gathers.append((ax, cur))
        regather = prm.in_block and any(a in DATA_AXES for a, _ in gathers)
        # bucketed: a block parameter moved to compute by gathers over data axes only, on a
        # mesh with a data axis (lower.py _block_spec)
        member = prm.in_block and bool(data_active) and all(a in DATA_AXES for a, _ in gathers)
        for ax, nb in gathers:
            add("all_gather", ax, "forward", nb * CB, "param gather at use", accum * k,
                bucket="gather" if member else None)
            if regather:
                add("all_gather", ax, "backward", nb * CB, "param re-gather in backward (ZeRO-3)", accum * k,
                    bucket="gather" if member else None)
        # Gradient reduction (lower.py _AtUse.backward): the gradient is Partial over each
        # data axis that splits the batch but not the parameter, and, under sequence
        # parallelism, over the seq axes for the norm weights (the only parameters used on
        # the seq-sharded residual stream).  It is reduce-scattered first over the axes its
        # grads placement shards (mesh order), then all-reduced over the rest, on the shard.
        gplan = pp.grads
        target = gplan if gplan is not None else pp.optimizer
        phase = "backward" if gplan is not None else "optimizer"
        cnt = (accum if gplan is not None else 1) * k
        gaxes, caxes = _dimplan_axes(target), _dimplan_axes(pp.compute)
        partial = [ax for ax in data_batch if ax not in caxes]
        if pp.axes == ("embed",):
            partial += [ax for ax in seq_axes if ax not in caxes]
        # In a bucket, gradients that go through the same reductions share them (bucket.py).
        route = (tuple(ax for ax in partial if ax in gaxes), tuple(ax for ax in partial if ax not in gaxes))
        # the optimizer's collectives are flat per block, and per chunk of the parameters
        # outside blocks (NOTE [optimizer chunks] in optim.py)
        root_member = local_root and not prm.in_block and not gathers
        chunk = "optimizer" if prm.in_block else ("optimizer", outside[id(prm)])
        rb = route if member and phase == "backward" else (chunk if phase == "optimizer" else None)
        if root_member and phase == "backward":
            rb = ("root", route)
        cur = _local_numel(pp, pp.compute, sizes)
        GB = RB if phase == "backward" else MB  # ZeRO-1 reduces the master's dtype at the step
        for ax in partial:
            if ax in gaxes:
                add("reduce_scatter", ax, phase, cur * GB, "gradient reduce-scatter", cnt, bucket=rb)
                cur //= sizes[ax]
        for ax in partial:
            if ax not in gaxes:
                what = "gradient all-reduce" if ax in DATA_AXES else "SP: norm weight grads (seq-sharded inputs)"
                add("all_reduce", ax, "backward" if ax not in DATA_AXES else phase, cur * GB, what, cnt, bucket=rb)
        # optimizer: refresh the stored parameter from its (sharded) master
        direct = pp.optimizer == pp.storage and gplan is not None and gplan == pp.optimizer and not mixed
        if not direct:
            cur = _local_numel(pp, pp.optimizer, sizes)
            for o_axes, s_axes in zip(pp.optimizer, pp.storage):
                for ax in reversed(o_axes):
                    if ax not in s_axes and sizes.get(ax, 1) > 1:
                        cur *= sizes[ax]
                        add("all_gather", ax, "optimizer", cur * B, "updated shard all-gather (ZeRO-1/2)", k,
                            bucket=chunk)
    # the scalar loss: a mean over the batch shards, one all-reduce per data mesh dim (of
    # the loss and its weight under a local root)
    for ax in data_batch:
        add("all_reduce", ax, "forward", 8 if local_root else 4, "scalar loss", accum)
    _activation_comm(cfg, lay, sizes, b, s, CB, add, accum, ckpt)
    return list(out.values())


def _outside_chunks(params_) -> dict[int, int]:
    """The optimizer chunk of each parameter outside the blocks (optim.outside_chunks, capped
    at one block's bytes, as ``ShardedOptimizer`` chunks them)."""
    def nbytes(prm):
        return math.prod(prm.plan.shape) * prm.plan.dtype.itemsize

    outside = [prm for prm in params_ if not prm.in_block]
    cap = sum(nbytes(prm) for prm in params_ if prm.in_block)
    return {id(prm): g for prm, g in zip(outside, outside_chunks([nbytes(prm) for prm in outside], cap))}


def _activation_comm(cfg, lay, sizes, b, s, B, add, accum, ckpt) -> None:
    """Megatron TP / TP+SP activation collectives over the tensor axis (tests/dist/test_budget.py
    derives the same counts)."""
    tp_axes = [a for a in lay.compute.get("heads", ()) if sizes.get(a, 1) > 1]
    if not tp_axes:
        return
    ax = tp_axes[0]
    L = cfg.layers
    bsh = b * s * cfg.embed * B
    sp = any(sizes.get(a, 1) > 1 for a in lay.compute.get("seq", ()))
    vocab_par = any(sizes.get(a, 1) > 1 for a in lay.compute.get("vocab", ()))
    n = accum
    if not sp:
        add("all_reduce", ax, "forward", bsh, "Megatron TP: attention and MLP outputs", 2 * L * n)
        add("all_reduce", ax, "backward", bsh, "Megatron TP: attention and MLP input grads", 2 * L * n)
        if vocab_par:
            add("all_reduce", ax, "forward", bsh, "vocab-parallel embedding output", n)
            add("all_reduce", ax, "backward", bsh, "vocab-parallel head: input grad", n)
        if ckpt:
            add("all_reduce", ax, "backward", bsh, "recompute: attention output (checkpointed block)", L * n)
    else:
        add("all_gather", ax, "forward", bsh, "TP+SP: block inputs gathered", 2 * L * n)
        add("reduce_scatter", ax, "forward", bsh, "TP+SP: block outputs reduce-scattered", 2 * L * n)
        add("all_gather", ax, "backward", bsh, "TP+SP: output grads gathered", 2 * L * n)
        add("reduce_scatter", ax, "backward", bsh, "TP+SP: input grads reduce-scattered", 2 * L * n)
        add("all_gather", ax, "forward", bsh, "TP+SP: output head input gathered", n)
        add("all_gather", ax, "backward", bsh, "TP+SP: embedding output grad gathered", n)
        if vocab_par:
            add("reduce_scatter", ax, "forward", bsh, "vocab-parallel embedding output", n)
            add("reduce_scatter", ax, "backward", bsh, "vocab-parallel head: input grad", n)
        if ckpt:
            add("all_gather", ax, "backward", bsh, "recompute: attention and MLP inputs (checkpointed block)",
                2 * L * n)
            add("reduce_scatter", ax, "backward", bsh, "recompute: attention output (checkpointed block)", L * n)



def _comm_formula(lay, cfg, psi, sizes, b, s, nbytes, batch_axes) -> dict[str, Any]:
    """``nbytes``: element bytes of the storage, compute and reduce dtypes."""
    B, CB, RB = nbytes
    out: dict[str, Any] = {}
    data = [a for a in batch_axes if a in DATA_AXES]
    n = _prod(data, sizes)
    t = sizes.get("tp", 1)
    if n > 1:
        stage3 = any(a in DATA_AXES for v in lay.params.values() for a in v)
        k = 3 if stage3 else 2
        # ZeRO-3: two gathers in the compute dtype + a reduce-scatter in the reduce dtype;
        # DDP: an all-reduce (reduce-scatter + all-gather) in the reduce dtype; ZeRO-1/2: a
        # reduce-scatter in the reduce dtype + an all-gather of the stored parameters.
        per = 2 * CB + RB if stage3 else RB + (RB if lay.name == "ddp" else B)
        terms = f"2·{CB}+{RB}" if stage3 else f"{RB}+{RB if lay.name == 'ddp' else B}"
        out["data"] = {"wire_bytes": (n - 1) / n * psi / t * per,
                       "text": f"{k}(N-1)/N·Ψ·B/t, here (N-1)/N·Ψ/t·({terms} bytes) with N={n}, t={t} "
                               f"({'ZeRO-3: gathers + reduce-scatter' if stage3 else 'DDP/ZeRO-1/2'})"}
    if t > 1:
        out["tp"] = {"wire_bytes": 4 * 2 * (t - 1) / t * b * s * cfg.embed * CB * cfg.layers,
                     "text": f"4·2(t-1)/t·bsh·B per layer × L={cfg.layers} (TP and TP+SP alike)"}
    return out


# --------------------------------------------------------------------------- report text
def _gib(x: float) -> str:
    return f"{x / GiB:9.3f} GiB"


def format_plan(p: Plan) -> str:
    """The human-readable report (docs/plan.md, "Reading the report")."""
    z, a = p.formulas["zero"], p.formulas["activations"]
    m = p.memory
    gpt = a["korthikanti_gpt_16bit_per_layer"] * a["layers"]
    lines = [
        f"meshlm plan: {p.model}, layout {p.layout}, mesh {_mesh_str(p.mesh)} ({p.world_size} ranks), "
        f"global batch {p.global_batch} x seq {p.seq}, {p.compute_dtype} compute, {p.param_dtype} storage (master "
        f"{p.master_dtype}, reduce {p.reduce_dtype}), "
        f"activation checkpointing {p.activation_checkpointing} (blocks: {a['checkpointing']})",
        "",
        f"{'memory per rank':<20}{'predicted':>14}{'formula':>16}",
        f"{'params':<20}{_gib(m['params']):>14}{_gib(z['params']):>16}",
        f"{'grads':<20}{_gib(m['grads']):>14}{_gib(z['grads']):>16}",
        f"{'optimizer':<20}{_gib(m['optimizer']):>14}{_gib(z['optimizer']):>16}",
        f"  ({z['text']})",
        f"{'activations':<20}{_gib(m['activations']):>14}{_gib(gpt):>16}   (formula: Korthikanti GPT block, 16-bit)",
        f"  ({a['text']}; held from forward to backward)",
        f"{'gathered weights':<20}{_gib(m['gathered']):>14}   (at-use copies kept for backward: output head, final norm)",
        f"{'recompute (peak)':<20}{_gib(m['recompute']):>14}   (one checkpointed block recomputed in backward)",
        f"{'total':<20}{_gib(m['total']):>14}",
        "",
        "",
        "communication per rank per step",
        f"{'collective':<16}{'axes':<6}{'phase':<10}{'count':>7}{'logical':>14}{'on wire':>14}  what",
    ]
    for c in sorted(p.comm, key=lambda c: (c.axes, ("forward", "backward", "optimizer").index(c.phase), c.kind)):
        lines.append(f"{c.kind:<16}{','.join(c.axes):<6}{c.phase:<10}{c.count:>7}{_gib(c.bytes):>14}"
                     f"{_gib(c.wire_bytes):>14}  {c.what}")
    lines.append(f"{'total on wire':<39}{_gib(p.comm_bytes()):>28}")
    for k, v in p.formulas["comm"].items():
        lines.append(f"  formula {k}: {_gib(v['wire_bytes'])}  ({v['text']})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- auto layout
def factorisations(world: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every way to write ``world`` as a product of sizes over ``axes`` (size 1 allowed)."""
    if not axes:
        return [{}] if world == 1 else []
    out = []
    for d in range(1, world + 1):
        if world % d == 0:
            for rest in factorisations(world // d, axes[1:]):
                out.append({axes[0]: d, **rest})
    return out


def step_time(p: Plan, cfg: LlamaConfig, hw: Hardware, overlap: bool = True) -> dict[str, float]:
    """Cost model (docs/plan.md): compute = (6·Ψ_non-emb + 12·L·h·s)·tokens FLOPs (x4/3 for
    the blocks under full activation checkpointing: one more forward) over the per-device
    share at peak·MFU; communication = each collective's ring wire bytes over the
    bandwidth of the link its axis crosses (the innermost axes that fit in a node use the
    intra-node link, the rest the inter-node one); step = max of the two when they overlap,
    else their sum."""
    tokens = p.global_batch * p.seq
    block = 6 * (cfg.num_params(embedding=False) - cfg.embed) + 12 * cfg.layers * cfg.embed * p.seq
    if p.activation_checkpointing == "full":
        block *= 4 / 3
    flops = (block + 6 * cfg.embed) * tokens / p.world_size
    t_comp = flops / (hw.peak_flops * hw.mfu)
    inner, acc = set(), 1
    for ax in reversed(list(p.mesh)):
        if acc * p.mesh[ax] > hw.node_size:
            break
        inner.add(ax)
        acc *= p.mesh[ax]
    t_comm = 0.0
    for c in p.comm:
        t_comm += c.wire_bytes / (hw.intra_bw if all(a in inner for a in c.axes) else hw.inter_bw)
    total = max(t_comp, t_comm) if overlap else t_comp + t_comm
    return {"compute_s": t_comp, "comm_s": t_comm, "step_s": total, "tokens_per_s": tokens / total if total else 0.0}


# The order candidates are tried in: of two that plan identically (hsdp with dp=1 is fsdp,
# fsdp_tp with tp=1 is fsdp), the earlier name is kept.
PREFERENCE = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")


class NothingFits(ConfigError):
    """No candidate layout fits the memory limit (the message says what to grow)."""


def parse_memory(v: Any) -> Optional[float]:
    """Bytes from ``"80GiB"``, ``"80GB"``, ``"512MiB"`` or a number of GiB; None stays None."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v) * GiB
    text = str(v).strip().lower().replace(" ", "")
    units = {"tib": 1024**4, "gib": GiB, "mib": 1024**2, "tb": 1e12, "gb": 1e9, "mb": 1e6, "b": 1}
    for u, k in units.items():
        if text.endswith(u):
            try:
                return float(text[: -len(u)]) * k
            except ValueError:
                break
    try:
        return float(text) * GiB
    except ValueError:
        raise ConfigError(f"plan.max_memory_per_device={v!r}: write a size like 80GiB, 141GB or 512MiB "
                          "(a bare number is GiB)") from None


def _hardware(name: str) -> Hardware:
    if name == "auto":
        name = "h100_nvlink_ib" if torch.cuda.is_available() else "cpu"
    if name not in HARDWARE:
        raise ConfigError(f"plan.profile={name!r}: unknown hardware profile; choose one of {', '.join(HARDWARE)} or auto")
    return HARDWARE[name]


@dataclass
class Candidate:
    plan: Plan
    time: dict[str, float]


def candidates(model: "str | LlamaConfig", devices: int, *, global_batch: int, seq: int,
               activation_checkpointing: str = "none", param_dtype: str = "float32",
               master_dtype: Optional[str] = None, grad_accum: int = 1,
               hardware: "str | Hardware" = "h100_nvlink_ib", overlap: bool = True,
               layouts: Optional[list[str]] = None, compute_dtype: str | None = None,
               reduce_dtype: str | None = None) -> list[Candidate]:
    """Every shipped layout on every factorisation of ``devices`` into (dp, fsdp, tp) that
    applies (dims divide, the batch splits, every axis of size > 1 is one the layout uses),
    planned and timed; duplicates (identical plans) dropped, keeping the PREFERENCE order."""
    hw = hardware if isinstance(hardware, Hardware) else _hardware(hardware)
    name, mcfg = model_config(model)
    names = layouts or sorted(shipped_layouts(), key=lambda n: (PREFERENCE.index(n) if n in PREFERENCE else 99, n))
    out, seen = [], set()
    for lay in names:
        used = load_layout(lay).mesh_axes_used()
        # dp largest first: of two meshes that plan alike (ddp over dp or over fsdp), the
        # plain data-parallel one is kept
        for m in sorted(factorisations(devices, ("dp", "fsdp", "tp")), key=lambda m: -m["dp"]):
            if any(sz > 1 and a not in used for a, sz in m.items()):
                continue  # every rank would repeat the same work on that axis
            if devices > 1 and not any(sz > 1 for sz in m.values()):
                continue
            try:
                p = plan(mcfg, lay, m, global_batch=global_batch, seq=seq, grad_accum=grad_accum,
                         activation_checkpointing=activation_checkpointing, param_dtype=param_dtype,
                         master_dtype=master_dtype, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)
            except MeshlmError:  # a dim does not divide, or the batch does not split
                continue
            p.model = name
            t = step_time(p, mcfg, hw, overlap)
            sig = (tuple(sorted(p.memory.items())), round(t["step_s"], 12), round(t["comm_s"], 12), tuple(sorted(
                (k[0], p.mesh[k[1][0]], k[2], v["count"], v["bytes"]) for k, v in p.comm_summary(by_phase=True).items())))
            if sig in seen:
                continue
            seen.add(sig)
            out.append(Candidate(p, t))
    return out


def choose_layout(cfg=None, *, model: "str | LlamaConfig" = "llama_small", devices: int = 1,
                  max_memory: "float | str | None" = None, global_batch: int = 16, seq: int = 128,
                  activation_checkpointing: str = "none", param_dtype: str = "float32",
                  master_dtype: Optional[str] = None, grad_accum: int = 1, hardware: str = "auto",
                  overlap: bool = True, png: Optional[str] = None, out=None,
                  top: int = 5, compute_dtype: str | None = None,
                  reduce_dtype: str | None = None) -> tuple[str, dict[str, int]]:
    """``layout=auto``: plan every candidate (:func:`candidates`), drop what does not fit
    ``max_memory`` per device (default: the hardware profile's memory), rank the rest by
    :func:`step_time`, print a ranked table (and write a PNG of the memory of the shown
    candidates to ``png``), and return the winner's (layout name, mesh sizes).

    ``cfg`` may be a :class:`meshlm.config.RunConfig`; its model, train and plan sections
    then replace the keywords.  Raises :class:`NothingFits` when nothing fits."""
    if cfg is not None:
        kw = _from_run_config(cfg)
        model, devices, global_batch, seq = kw["model"], kw["devices"], kw["global_batch"], kw["seq"]
        activation_checkpointing, param_dtype, grad_accum = kw["ac"], kw["param_dtype"], kw["grad_accum"]
        master_dtype, compute_dtype, reduce_dtype = kw["master_dtype"], kw["compute_dtype"], kw["reduce_dtype"]
        max_memory, hardware, overlap, png, top = kw["max_memory"], kw["profile"], kw["overlap"], kw["png"], kw["top"]
    out = out or sys.stdout
    hw = _hardware(hardware)
    cap = parse_memory(max_memory) if max_memory is not None else hw.memory
    rows = candidates(model, devices, global_batch=global_batch, seq=seq, activation_checkpointing=activation_checkpointing,
                      param_dtype=param_dtype, master_dtype=master_dtype, grad_accum=grad_accum, hardware=hw,
                      overlap=overlap, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    fits = sorted((r for r in rows if r.plan.memory["total"] <= cap),
                  key=lambda r: (r.time["step_s"], r.time["comm_s"], r.plan.memory["total"]))
    if png:
        shown = fits[:top] or sorted(rows, key=lambda r: r.plan.memory["total"])[:top]
        _plot([r.plan for r in shown], png, cap)
    if not fits:
        raise NothingFits(nothing_fits([r.plan for r in rows], cap, devices, activation_checkpointing))
    out.write(format_candidates(fits[:top], hw, cap, overlap, len(rows), len(fits)) + "\n")
    best = fits[0].plan
    return best.layout, {k: v for k, v in best.mesh.items() if v > 1} or {"dp": 1}


def _mesh_str(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "1 device"


def format_candidates(rows: list[Candidate], hw: Hardware, cap: float, overlap: bool, n_all: int, n_fit: int) -> str:
    p0 = rows[0].plan
    lines = [f"meshlm plan: layout=auto for {p0.model} on {p0.world_size} devices ({hw.name}, "
             f"{cap / GiB:.1f} GiB each), global batch {p0.global_batch} x seq {p0.seq}: "
             f"{n_fit} of {n_all} candidates fit; step = {'max' if overlap else 'sum'}(compute, comm)",
             f"{'rank':<5}{'layout':<12}{'mesh':<20}{'state GiB':>10}{'act GiB':>9}{'total GiB':>10}"
             f"{'compute s':>11}{'comm s':>10}{'step s':>10}{'tok/s/dev':>11}"]
    for i, r in enumerate(rows, 1):
        p, t, m = r.plan, r.time, r.plan.memory
        state = m["params"] + m["grads"] + m["optimizer"]
        act = m["activations"] + m["gathered"] + m["recompute"]
        lines.append(f"{i:<5}{p.layout:<12}{_mesh_str(p.mesh):<20}{state / GiB:>10.2f}{act / GiB:>9.2f}"
                     f"{m['total'] / GiB:>10.2f}{t['compute_s']:>11.4f}{t['comm_s']:>10.4f}{t['step_s']:>10.4f}"
                     f"{t['tokens_per_s'] / p.world_size:>11.0f}")
    return "\n".join(lines)


def nothing_fits(plans: list[Plan], cap: float, devices: int = 0, ac: str = "none") -> str:
    if not plans:
        return (f"no layout applies to this model on {devices} devices: no factorisation into (dp, fsdp, tp) divides "
                "its dims and the batch; change the device count or train.batch_size")
    p = min(plans, key=lambda p: p.memory["total"])
    parts = {k: v for k, v in p.memory.items() if k != "total"}
    dom = max(parts, key=parts.get)
    if p.formulas.get("activations", {}).get("checkpointing") == "full":
        ac = "full"  # its blocks already keep only their inputs
    advice = {
        "activations": ("use smaller micro-batches (train.grad_accum) or shard the sequence (tp_sp, fsdp_tp_sp)"
                        if ac == "full" else
                        f"turn on activation checkpointing (train.activation_checkpointing="
                        f"{'full' if ac == 'selective' else 'selective or full'}), use smaller micro-batches "
                        "(train.grad_accum) or shard the sequence (tp_sp, fsdp_tp_sp)"),
        "recompute": "use smaller micro-batches (train.grad_accum) or grow tp",
        "gathered": "grow tp (shards the output head) or add devices",
        "optimizer": "shard the optimizer state over more ranks (more fsdp: zero1/zero2/fsdp layouts) or add devices",
        "params": "shard the parameters (fsdp or tp) over more ranks, or add devices",
        "grads": "shard the gradients (zero2/fsdp) over more ranks, or add devices",
    }[dom]
    return (f"nothing fits in {cap / GiB:.1f} GiB per device. The smallest any candidate reaches is "
            f"{p.memory['total'] / GiB:.2f} GiB ({p.layout}, {_mesh_str(p.mesh)}), dominated by {dom} "
            f"({parts[dom] / GiB:.2f} GiB): {advice}.")


def _plot(plans: list[Plan], path: str, cap: Optional[float] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(plans)), 4))
    labels = [f"{p.layout}\n" + _mesh_str(p.mesh).replace(",", "\n") for p in plans]
    bottom = [0.0] * len(plans)
    for key in ("params", "grads", "optimizer", "activations", "gathered", "recompute"):
        vals = [p.memory[key] / GiB for p in plans]
        ax.bar(labels, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if cap:
        ax.axhline(cap / GiB, color="k", linestyle="--", linewidth=1, label="limit")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{plans[0].model}: memory per device of each candidate" if plans else "")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- entry point
def _from_run_config(cfg) -> dict[str, Any]:
    """What the planner needs from a :class:`meshlm.config.RunConfig`."""
    from meshlm.precision import main_grads_allowed

    t, pc = cfg.train, cfg.plan
    devices = pc.devices
    if devices is None:
        d = cfg.mesh.as_dict()
        if -1 in d.values():
            raise ConfigError(f"mesh {cfg.mesh} has an axis of -1: set plan.devices to the number of devices")
        devices = math.prod(d.values())
    return {"model": (cfg.model.name, cfg.model.llama()), "devices": devices, "global_batch": t.batch_size,
            "seq": t.seq_len, "ac": t.activation_checkpointing, "grad_accum": t.grad_accum,
            # as meshlm.train (train.shard_dtypes): float32 storage, which is the master copy,
            # used in train.param_dtype, or (ZeRO-1/2) storage in train.param_dtype with float32
            # main gradients and master, chosen per layout ("auto"; NOTE [mixed precision]);
            # gradients reduced in train.reduce_dtype
            "param_dtype": "auto" if main_grads_allowed(t) else "float32", "master_dtype": None,
            "compute_dtype": t.param_dtype,
            "reduce_dtype": t.reduce_dtype,
            "max_memory": pc.max_memory_per_device, "profile": pc.profile, "overlap": pc.overlap, "png": pc.png,
            "top": pc.top, "format": pc.format}


def plan_main(cfg) -> int:
    """``meshlm plan``: the plan of ``model`` under ``layout`` on ``mesh`` (text, or JSON
    with ``plan.format=json``); with ``layout=auto``, the ranked candidates and the
    winner's plan (and a PNG: ``plan.png``, else ``outputs/plan/<date>/<time>/plan.png``
    under the current directory, as ``meshlm train`` puts its run directories)."""
    kw = _from_run_config(cfg)
    name, mcfg = kw["model"]
    layout = cfg.layout.name
    mesh = cfg.mesh.as_dict()
    if layout == "auto":
        png = kw["png"] or str(Path("outputs", "plan", *time.strftime("%Y-%m-%d %H-%M-%S").split(), "plan.png"))
        layout, mesh = choose_layout(model=kw["model"], devices=kw["devices"], max_memory=kw["max_memory"],
                                     global_batch=kw["global_batch"], seq=kw["seq"], activation_checkpointing=kw["ac"],
                                     param_dtype=kw["param_dtype"], master_dtype=kw["master_dtype"],
                                     compute_dtype=kw["compute_dtype"], reduce_dtype=kw["reduce_dtype"],
                                     grad_accum=kw["grad_accum"], hardware=kw["profile"],
                                     overlap=kw["overlap"], png=png, top=kw["top"],
                                     out=sys.stdout if kw["format"] == "text" else io.StringIO())
        if kw["format"] == "text":
            print(f"(memory breakdown of these candidates: {png})\n")
    p = plan(mcfg, layout, MeshSpec.parse(mesh, kw["devices"]), global_batch=kw["global_batch"], seq=kw["seq"],
             activation_checkpointing=kw["ac"], param_dtype=kw["param_dtype"], master_dtype=kw["master_dtype"],
             compute_dtype=kw["compute_dtype"], reduce_dtype=kw["reduce_dtype"],
             grad_accum=kw["grad_accum"])
    p.model = name
    if kw["format"] == "json":
        print(json.dumps(p.to_json(), indent=1))
    else:
        print(format_plan(p))
    return 0
