"""``meshlm plan``: per-rank memory and communication of a model under a layout and mesh,
without the hardware, and automatic layout choice under a memory limit.

Everything is computed analytically from the per-parameter plans of
``meshlm.lower.plan_params`` on a meta-device model (no tracing, no process group), so
Llama 3 405B on 16,384 ranks plans in seconds.  Each figure sits beside its textbook
formula (REFERENCE.md): ZeRO model-state memory, DDP/ZeRO/Megatron communication volume,
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

import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

import torch

from meshlm.axes import DATA_AXES
from meshlm.comm import ring_factor
from meshlm.layout import Layout, load_layout, shipped_layouts
from meshlm.lower import ParamPlan, plan_params
from meshlm.mesh import MeshSpec
from meshlm.models import Llama, LlamaConfig, llama_config

SCHEMA_VERSION = 1
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(d: "str | torch.dtype | None", default: torch.dtype = torch.float32) -> torch.dtype:
    if d is None:
        return default
    return d if isinstance(d, torch.dtype) else _DTYPES[d]


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
    param_dtype: str
    master_dtype: str
    activation_checkpointing: str
    memory: dict[str, int]  # params, grads, optimizer, activations, total (bytes per rank)
    formulas: dict[str, Any]  # textbook figure beside each predicted number
    comm: list[CommEntry] = field(default_factory=list)

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


def _dimplan_axes(plan) -> set[str]:
    return {a for axes in plan for a in axes}


def model_config(model: "str | LlamaConfig") -> tuple[str, LlamaConfig]:
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
) -> Plan:
    """Predict per-rank memory and per-step communication (see the module docstring).

    ``global_batch`` sequences per optimizer step over all ranks, in ``grad_accum``
    micro-batches; activations are per micro-batch.  ``activation_checkpointing`` is
    ``none``, ``selective`` or ``full`` (``train.activation_checkpointing``)."""
    name, cfg = model_config(model)
    lay = load_layout(layout)
    spec = MeshSpec.parse(mesh)
    sizes = {a: s for a, s in spec.axes}
    if activation_checkpointing not in ("none", "selective", "full"):
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: choose none, selective or full")
    params_ = _param_plans(cfg, lay, sizes)
    pdt = _dtype(param_dtype)
    mdt = _dtype(master_dtype, pdt)
    B, MB = _bytes(pdt), _bytes(mdt)
    batch_axes = _batch_axes(lay, sizes)
    n_batch = _prod(batch_axes, sizes) * grad_accum
    if global_batch % n_batch:
        raise ConfigError(f"global batch {global_batch} does not split into {grad_accum} micro-batch(es) over "
                          f"the batch axes {batch_axes or ['-']} of mesh {dict(sizes)} ({n_batch} shards)")

    # ---------------------------------------------------------------- model state
    params = grads = optim = 0
    for prm in params_:
        pp, k = prm.plan, prm.count
        n_store = _local_numel(pp, pp.storage, sizes)
        n_opt = _local_numel(pp, pp.optimizer, sizes)
        params += k * n_store * B
        gplan = pp.grads if pp.grads is not None else pp.storage  # ZeRO-1: whole local grads
        grads += k * _local_numel(pp, gplan, sizes) * B
        direct = pp.optimizer == pp.storage and pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt
        # AdamW: exp_avg + exp_avg_sq in the master dtype, a float32 `step` scalar
        optim += k * (2 * n_opt * MB + 4)
        if not direct:
            optim += k * n_opt * MB  # the master copy
            # the master's gradient is a new buffer unless the grad already is in optimizer
            # placements and dtype (ZeRO-2 in fp32: the same tensor)
            if not (pp.grads is not None and pp.grads == pp.optimizer and mdt == pdt):
                grads += k * n_opt * MB

    psi = cfg.num_params()
    t = sizes.get("tp", 1)
    formulas: dict[str, Any] = {
        "psi": psi,
        "zero": _zero_formula(lay, psi, _shard_n(lay, sizes), t, B, MB),
    }

    # ---------------------------------------------------------------- activations
    b_local = global_batch // n_batch
    regather = any(prm.in_block and _regathers(prm.plan, sizes) for prm in params_)
    act = activation_bytes(cfg, lay, sizes, b_local, seq, activation_checkpointing, pdt, regather=regather)
    gathered = _held_gathered(params_, sizes, regather, B)
    formulas["activations"] = act
    memory = {"params": params, "grads": grads, "optimizer": optim, "activations": act["held"],
              "gathered": gathered, "recompute": act["recompute"]}
    memory["total"] = sum(memory.values())

    ckpt = regather or activation_checkpointing != "none"
    comm = _comm(cfg, lay, sizes, params_, b_local, seq, B, mdt != pdt, batch_axes, grad_accum, ckpt)
    formulas["comm"] = _comm_formula(lay, cfg, psi, sizes, b_local, seq, B, batch_axes)
    return Plan(name, lay.name, dict(sizes), spec.size, global_batch, seq, str(pdt).removeprefix("torch."),
                str(mdt).removeprefix("torch."), activation_checkpointing, memory, formulas, comm)


def _regathers(pp: ParamPlan, sizes: Mapping[str, int]) -> bool:
    """Gathered over a data axis at use (lower.py ``_needs_regather``, on active axes)."""
    return any(a in DATA_AXES and a not in c and sizes.get(a, 1) > 1 for s_, c in zip(pp.storage, pp.compute) for a in s_)


def _held_gathered(params_: list[_Param], sizes: Mapping[str, int], regather: bool, B: int) -> int:
    """Bytes of at-use copies of parameters that autograd keeps from forward to backward.

    A parameter whose compute placements differ from its storage is redistributed (a new
    tensor) at use, and ``F.linear``/the norm's multiply save that copy for backward.  Block
    parameters gathered over a data axis are not kept (NOTE [re-gather in backward]); the
    embedding table is not kept either (``F.embedding`` saves only the token ids), unless it
    is tied to the output head."""
    out = 0
    for prm in params_:
        pp = prm.plan
        if [[a for a in d if sizes.get(a, 1) > 1] for d in pp.compute] == \
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


def _zero_formula(lay: Layout, psi: int, n: int, t: int, B: int, MB: int) -> dict[str, Any]:
    """ZeRO-paper model-state bytes per rank for this layout's stage, TP dividing by t.
    (Uses Ψ of the whole model; replicated norms make the exact figure a little larger.)"""
    stage = {"zero1": 1, "zero2": 2}.get(lay.name)
    if stage is None:
        stage = 3 if any(a in DATA_AXES for v in lay.params.values() for a in v) else 0
    nn_ = max(n if stage else 1, 1)
    # hsdp shards over fsdp only
    p = psi / t
    params = p * B / (nn_ if stage == 3 else 1)
    grads = p * B / (nn_ if stage >= 2 else 1)
    opt = p * (2 * MB) / (nn_ if stage >= 1 else 1) + (p * MB / nn_ if (stage in (1, 2) or MB != B) else 0)
    return {"stage": stage, "params": params, "grads": grads, "optimizer": opt,
            "text": f"ZeRO-{stage}: params {B}Ψ/{'N' if stage == 3 else '1'}, grads {B}Ψ/{'N' if stage >= 2 else '1'}, "
                    f"Adam {2 * MB}Ψ/{'N' if stage >= 1 else '1'} (+ master {MB}Ψ/N if separate), Ψ/t with t={t}"}


#ACT

#COMM

def _comm_formula(lay, cfg, psi, sizes, b, s, B, batch_axes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data = [a for a in batch_axes if a in DATA_AXES]
    n = _prod(data, sizes)
    t = sizes.get("tp", 1)
    if n > 1:
        stage3 = any(a in DATA_AXES for v in lay.params.values() for a in v)
        k = 3 if stage3 else 2
        out["data"] = {"wire_bytes": k * (n - 1) / n * psi / t * B,
                       "text": f"{k}(N-1)/N·Ψ·B/t with N={n}, t={t} ({'ZeRO-3' if stage3 else 'DDP/ZeRO-1/2'})"}
    if t > 1:
        out["tp"] = {"wire_bytes": 4 * 2 * (t - 1) / t * b * s * cfg.embed * B * cfg.layers,
                     "text": f"4·2(t-1)/t·bsh·B per layer × L={cfg.layers} (TP and TP+SP alike)"}
    return out


# --------------------------------------------------------------------------- report text
def _gib(x: float) -> str:
    return f"{x / GiB:9.3f} GiB"


def format_plan(p: Plan) -> str:
    z = p.formulas["zero"]
    lines = [
        f"meshlm plan: {p.model}, layout {p.layout}, mesh {p.mesh} ({p.world_size} ranks), "
        f"global batch {p.global_batch} x seq {p.seq}, {p.param_dtype} (master {p.master_dtype}), "
        f"activation checkpointing {p.activation_checkpointing}",
        "",
        f"{'memory per rank':<18}{'predicted':>14}{'formula':>16}",
        f"{'params':<18}{_gib(p.memory['params']):>14}{_gib(z['params']):>16}",
        f"{'grads':<18}{_gib(p.memory['grads']):>14}{_gib(z['grads']):>16}",
        f"{'optimizer':<18}{_gib(p.memory['optimizer']):>14}{_gib(z['optimizer']):>16}",
        f"{'activations':<18}{_gib(p.memory['activations']):>14}   {p.formulas['activations']['text']}",
        f"{'total':<18}{_gib(p.memory['total']):>14}",
        f"  ({z['text']})",
        "",
        f"{'communication per step':<24}{'axes':<8}{'phase':<11}{'count':>6}{'logical':>14}{'on wire':>14}  what",
    ]
    for c in sorted(p.comm, key=lambda c: (c.axes, c.phase, c.kind)):
        lines.append(f"{c.kind:<24}{','.join(c.axes):<8}{c.phase:<11}{c.count:>6}{_gib(c.bytes):>14}"
                     f"{_gib(c.wire_bytes):>14}  {c.what}")
    lines.append(f"{'total on wire':<49}{_gib(p.comm_bytes()):>28}")
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


def step_time(p: Plan, hw: Hardware, overlap: bool = True) -> dict[str, float]:
    """Cost model (docs/plan.md): compute = 6·Ψ_non-emb·tokens + 12·L·h·s·tokens FLOPs over
    the per-device share at peak·MFU; communication = wire bytes over the link the axis
    crosses (tp and fsdp inside a node when the inner axes fit, dp across)."""
    _, cfg = model_config(p.model) if p.model != "custom" else (None, None)
    tokens = p.global_batch * p.seq
    psi_ne = cfg.num_params(embedding=False)
    flops = (6 * psi_ne + 12 * cfg.layers * cfg.embed * p.seq) * tokens / p.world_size
    t_comp = flops / (hw.peak_flops * hw.mfu)
    # which axes stay inside a node: innermost first
    inner, acc = set(), 1
    for ax in reversed(list(p.mesh)):
        if acc * p.mesh[ax] <= hw.node_size:
            inner.add(ax)
            acc *= p.mesh[ax]
    t_comm = 0.0
    for c in p.comm:
        bw = hw.intra_bw if all(a in inner for a in c.axes) else hw.inter_bw
        t_comm += c.wire_bytes / bw
    total = max(t_comp, t_comm) if overlap else t_comp + t_comm
    return {"compute_s": t_comp, "comm_s": t_comm, "step_s": total}


def choose_layout(cfg=None, *, model: "str | LlamaConfig" = "llama_small", devices: int = 1,
                  max_memory: Optional[float] = None, global_batch: int = 16, seq: int = 128,
                  activation_checkpointing: str = "none", hardware: str = "h100_nvlink_ib", overlap: bool = True,
                  param_dtype: str = "float32", png: Optional[str] = None, out=sys.stdout, top: int = 10
                  ) -> tuple[str, dict[str, int]]:
    """Enumerate shipped layouts x factorisations of ``devices`` into (dp, fsdp, tp), drop
    what does not fit ``max_memory`` bytes per device, rank by :func:`step_time`, print a
    ranked table (and a PNG of each candidate's memory), and return the winner.

    ``cfg`` may be a RunConfig (meshlm.config); its fields override the keywords."""
    if cfg is not None:
        model, devices, global_batch, seq, activation_checkpointing, param_dtype, max_memory, top = _from_run_config(
            cfg, model, devices, global_batch, seq, activation_checkpointing, param_dtype, max_memory, top)
    hw = HARDWARE[hardware]
    cap = max_memory if max_memory is not None else hw.memory
    name, mcfg = model_config(model)
    rows = []
    for lay in shipped_layouts():
        if lay == "single" and devices > 1:
            continue
        for m in factorisations(devices, ("dp", "fsdp", "tp")):
            try:
                p = plan(mcfg, lay, m, global_batch=global_batch, seq=seq,
                         activation_checkpointing=activation_checkpointing, param_dtype=param_dtype)
            except Exception:  # does not divide, or an axis the layout cannot use
                continue
            if not _uses_all_axes(lay, m):
                continue
            p.model = name
            rows.append((p, step_time(p, hw, overlap)))
    fits = [r for r in rows if r[0].memory["total"] <= cap]
    fits.sort(key=lambda r: (r[1]["step_s"], r[0].memory["total"]))
    if png:
        _plot([r[0] for r in (fits or sorted(rows, key=lambda r: r[0].memory["total"]))[:top]], png)
    if not fits:
        out.write(nothing_fits(rows, cap) + "\n")
        raise SystemExit(2)
    out.write(f"{'rank':<5}{'layout':<12}{'mesh':<22}{'memory':>13}{'compute s':>11}{'comm s':>10}{'step s':>10}\n")
    for i, (p, t) in enumerate(fits[:top], 1):
        ms = ",".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1) or "1"
        out.write(f"{i:<5}{p.layout:<12}{ms:<22}{_gib(p.memory['total']):>13}{t['compute_s']:>11.4f}"
                  f"{t['comm_s']:>10.4f}{t['step_s']:>10.4f}\n")
    best = fits[0][0]
    return best.layout, {k: v for k, v in best.mesh.items() if v > 1} or {"dp": 1}


def _uses_all_axes(lay: str, mesh: Mapping[str, int]) -> bool:
    """Skip meshes with an axis of size > 1 the layout never uses (every rank would repeat
    the same work on it)."""
    used = load_layout(lay).mesh_axes_used()
    return all(s == 1 or a in used for a, s in mesh.items())


def nothing_fits(rows, cap: float) -> str:
    if not rows:
        return "no layout applies to this model and device count (no factorisation divides its dims)"
    p = min((r[0] for r in rows), key=lambda p: p.memory["total"])
    parts = {k: v for k, v in p.memory.items() if k != "total"}
    dom = max(parts, key=parts.get)
    advice = {
        "activations": "turn on activation checkpointing (train.activation_checkpointing=full), use a smaller "
                       "micro-batch (train.grad_accum) or grow tp with sequence parallelism (tp_sp, fsdp_tp_sp)",
        "optimizer": "shard the optimizer state over more ranks (grow fsdp; zero1/zero2/fsdp layouts) or add devices",
        "params": "shard the parameters (fsdp or tp) over more ranks, or add devices",
        "grads": "shard the gradients (zero2/fsdp) over more ranks, or add devices",
    }[dom]
    ms = ",".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1)
    return (f"nothing fits in {cap / GiB:.1f} GiB per device. The smallest any candidate reaches is "
            f"{p.memory['total'] / GiB:.2f} GiB ({p.layout}, {ms}), dominated by {dom} "
            f"({parts[dom] / GiB:.2f} GiB): {advice}.")


def _plot(plans: list[Plan], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(plans)), 4))
    labels = [f"{p.layout}\n" + ",".join(f"{k}{v}" for k, v in p.mesh.items() if v > 1) for p in plans]
    bottom = [0.0] * len(plans)
    for key in ("params", "grads", "optimizer", "activations"):
        vals = [p.memory[key] / GiB for p in plans]
        ax.bar(labels, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("GiB per device")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- entry point
def _from_run_config(cfg, model, devices, global_batch, seq, ac, param_dtype, max_memory, top):
    m = getattr(cfg, "model", None)
    model = getattr(m, "name", model) if m is not None else model
    t = getattr(cfg, "train", None)
    if t is not None:
        global_batch = getattr(t, "batch_size", global_batch) // max(getattr(t, "grad_accum", 1), 1) * max(
            getattr(t, "grad_accum", 1), 1)
        seq = getattr(t, "seq_len", seq)
        ac = getattr(t, "activation_checkpointing", ac)
        param_dtype = getattr(t, "param_dtype", param_dtype)
    pc = getattr(cfg, "plan", None)
    if pc is not None:
        devices = getattr(pc, "devices", None) or devices
        gib = getattr(pc, "max_memory_per_device", None) or getattr(pc, "device_memory_gib", None)
        if isinstance(gib, str):
            gib = float(gib.lower().removesuffix("gib"))
        max_memory = gib * GiB if gib else max_memory
        top = getattr(pc, "top", top)
    return model, devices, global_batch, seq, ac, param_dtype, max_memory, top


def plan_main(cfg) -> int:
    """``meshlm plan``: print (or ``plan.format=json``) the plan for a RunConfig."""
    mesh = getattr(cfg.mesh, "shape", None) or {k: v for k, v in vars(cfg.mesh).items() if isinstance(v, int)}
    layout = getattr(cfg.layout, "name", cfg.layout)
    model, _d, gb, seq, ac, pdt, _mm, _top = _from_run_config(cfg, "llama_small", 1, 16, 128, "none", "float32", None, 5)
    if layout == "auto":
        choose_layout(cfg)
        return 0
    p = plan(model, layout, mesh, global_batch=gb, seq=seq, activation_checkpointing=ac, param_dtype=pdt,
             grad_accum=getattr(cfg.train, "grad_accum", 1))
    if getattr(getattr(cfg, "plan", None), "format", "text") == "json":
        print(json.dumps(p.to_json(), indent=1))
    else:
        print(format_plan(p))
    return 0
