"""The plan: per-rank memory and communication of one (model, layout, mesh, batch,
seq) point, its JSON form and its text report."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from meshlm.layout.offload import KINDS
from meshlm.layout.precision import DTYPES as _DTYPES
from meshlm.plan.offload import lines as _offload_lines

SCHEMA_VERSION = 1
GiB = 1024**3


def _dtype(d: "str | torch.dtype | None", default: torch.dtype = torch.float32) -> torch.dtype:
    if d is None:
        return default
    return d if isinstance(d, torch.dtype) else _DTYPES[d]


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _bytes(d: torch.dtype) -> int:
    return torch.empty((), dtype=d).element_size()


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
    #: the tier of each kind of state and the offloaded kinds' figures (NOTE [planned offload]
    #: in meshlm/plan/offload.py); empty: every kind on the device
    offload: dict[str, Any] = field(default_factory=dict)
    #: bytes per rank on each tier (device, host, disk); empty: all on the device (``tier_bytes``)
    tiers: dict[str, int] = field(default_factory=dict)
    #: per scope of a scoped layout: {memory: {params, grads, optimizer}, comm: {"kind axis
    #: phase": bytes}} (NOTE [planned scopes] in meshlm/plan/scopes.py); empty: no scopes
    scopes: dict[str, Any] = field(default_factory=dict)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes per rank on each tier: ``device`` is ``memory["total"]``."""
        return self.tiers or {"device": int(self.memory.get("total", 0)), "host": 0, "disk": 0}

    def offload_json(self) -> dict[str, Any]:
        """``offload`` of the JSON: the tier of each kind and the offloaded kinds' figures."""
        return self.offload or {**dict.fromkeys(KINDS, "device"), "kinds": {}, "device_is_host": False}

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
        d["offload"], d["tiers"] = self.offload_json(), self.tier_bytes()
        return d


def _mesh_str(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "1 device"


# --------------------------------------------------------------------------- report text
def _gib(x: float) -> str:
    return f"{x / GiB:9.3f} GiB"


def format_plan(p: Plan) -> str:
    """The human-readable report (docs/plan.md, "Reading the report")."""
    if "stages" in p.formulas:
        return _format_pipeline(p)
    if "peak" in p.memory:
        return _format_measured(p)
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
        *_moe_lines(p)[:1],
        f"{'grads':<20}{_gib(m['grads']):>14}{_gib(z['grads']):>16}",
        f"{'optimizer':<20}{_gib(m['optimizer']):>14}{_gib(z['optimizer']):>16}",
        f"  ({z['text']})",
        f"{'activations':<20}{_gib(m['activations']):>14}{_gib(gpt):>16}   (formula: Korthikanti GPT block, 16-bit)",
        f"  ({a['text']}; held from forward to backward)",
        f"{'gathered weights':<20}{_gib(m['gathered']):>14}   (at-use copies kept for backward: output head, final norm)",
        f"{'recompute (peak)':<20}{_gib(m['recompute']):>14}   (one checkpointed block recomputed in backward)",
        f"{'total':<20}{_gib(m['total']):>14}",
        *_offload_lines(p),
        "",
        "",
        "communication per rank per step",
        f"{'collective':<16}{'axes':<6}{'phase':<10}{'count':>7}{'logical':>14}{'on wire':>14}  what",
    ]
    for c in sorted(p.comm, key=lambda c: (c.axes, ("forward", "backward", "optimizer").index(c.phase), c.kind)):
        lines.append(
            f"{c.kind:<16}{','.join(c.axes):<6}{c.phase:<10}{c.count:>7}{_gib(c.bytes):>14}"
            f"{_gib(c.wire_bytes):>14}  {c.what}"
        )
    lines.append(f"{'total on wire':<39}{_gib(p.comm_bytes()):>28}")
    return _comm_lines(p, lines)


def _comm_lines(p: Plan, lines: list[str]) -> str:
    for k, v in p.formulas["comm"].items():
        lines.append(f"  formula {k}: {_gib(v['wire_bytes'])}  ({v['text']})")
    return "\n".join(lines)


def _parts(p: Plan) -> dict[str, float]:
    """Memory by kind: the analytic plan's, or a measured one's model state and the rest
    of its peak (``activations``: what the step adds at its peak)."""
    m = p.memory
    if "peak" not in m:
        return {k: v for k, v in m.items() if k != "total"}
    state = {k: m[k] for k in ("params", "grads", "optimizer")}
    return dict(state, activations=m["peak"] - sum(state.values()))


def _format_measured(p: Plan) -> str:
    """The report of a measured plan (NOTE [fake measurement] in measure.py)."""
    z, m = p.formulas["zero"], p.memory
    lines = [
        f"meshlm plan: {p.model}, layout {p.layout}, mesh {_mesh_str(p.mesh)} ({p.world_size} ranks), "
        f"global batch {p.global_batch} x seq {p.seq}, {p.compute_dtype} compute, {p.param_dtype} storage (master "
        f"{p.master_dtype}, reduce {p.reduce_dtype}), activation checkpointing {p.activation_checkpointing}; "
        f"measured on fake tensors ({p.formulas['psi'] / 1e6:.1f}M params, {p.formulas['flops'] / 1e12:.3f} "
        "TFLOP per rank per step)",
        "",
        f"{'memory per rank':<20}{'measured':>14}{'formula':>16}",
        f"{'params':<20}{_gib(m['params']):>14}{_gib(z['params']):>16}",
        *_moe_lines(p)[:1],
        f"{'grads':<20}{_gib(m['grads']):>14}{_gib(z['grads']):>16}",
        f"{'optimizer':<20}{_gib(m['optimizer']):>14}{_gib(z['optimizer']):>16}",
        f"  ({z['text']})",
        f"{'activations':<20}{_gib(m['activations']):>14}   (held from forward to backward)",
        f"{'gathered weights':<20}{_gib(m.get('gathered', 0)):>14}   (parameter copies held with them: at-use "
        "gathers, casts)",
        f"{'peak':<20}{_gib(m['peak']):>14}   (the most tensor storage alive at once in a step, model state included)",
        *_offload_lines(p),
        "",
        "",
        "communication per rank per step (counted)",
        f"{'collective':<16}{'axes':<6}{'phase':<10}{'count':>7}{'logical':>14}{'on wire':>14}",
    ]
    for c in sorted(p.comm, key=lambda c: (c.axes, ("forward", "backward", "optimizer").index(c.phase), c.kind)):
        lines.append(
            f"{c.kind:<16}{','.join(c.axes):<6}{c.phase:<10}{c.count:>7}{_gib(c.bytes):>14}{_gib(c.wire_bytes):>14}"
        )
    lines.append(f"{'total on wire':<39}{_gib(p.comm_bytes()):>28}")
    return "\n".join(lines + _moe_lines(p)[1:] + _scope_lines(p))


def _moe_lines(p: Plan) -> list[str]:
    """A mixture of experts' figures (NOTE [planned experts] in meshlm/plan/moe.py)."""
    e = p.formulas.get("moe")
    if not e:
        return []
    out = [
        f"{'  experts':<20}{_gib(e['expert_bytes']):>14}   ({e['layers']} MoE layers of {e['experts']} experts, "
        f"top {e['top_k']}; {e['total'] / 1e6:.1f}M params, {e['active'] / 1e6:.1f}M active per token)",
    ]
    if e["all_to_all_count"]:
        out.append(
            f"all-to-all of expert parallelism (routing formula): {e['all_to_all_count']} per micro-batch in forward "
            f"and as many in backward over {','.join(e['ep_axes'])}, {_gib(e['all_to_all_bytes'])} each"
        )
    return out


def _scope_lines(p: Plan) -> list[str]:
    """Per scope: model state (measured) and parameter traffic (planned), NOTE [planned
    scopes] in meshlm/plan/scopes.py."""
    if not p.scopes:
        return []
    out = ["", "", "per scope, per rank (model state measured; parameter gathers and gradient reductions planned)"]
    out.append(f"{'scope':<14}{'params':>12}{'grads':>12}{'optimizer':>12}  parameter traffic (logical)")
    for name, sc in p.scopes.items():
        m = sc["memory"]
        traffic = ", ".join(f"{k} {_size(v)}" for k, v in sc["comm"].items()) or "none"
        out.append(f"{name:<14}{_size(m['params']):>12}{_size(m['grads']):>12}{_size(m['optimizer']):>12}  {traffic}")
    return out


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps the number at least 1 (``12.4 KiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _format_pipeline(p: Plan) -> str:
    """The report of a pipeline plan (NOTE [planning stages] in pipeline.py): every pp rank."""
    f = p.formulas
    lines = [
        f"meshlm plan: {p.model}, layout {p.layout}, mesh {_mesh_str(p.mesh)} ({p.world_size} ranks), "
        f"global batch {p.global_batch} x seq {p.seq}, {p.compute_dtype} compute, {p.param_dtype} storage, "
        f"activation checkpointing {p.activation_checkpointing}; pipeline schedule {f['schedule']}, bubble "
        f"{f['bubble']:.3f} of a step by its formula; measured on fake tensors per pp rank ({f['psi'] / 1e6:.1f}M "
        f"params, {f['flops'] / 1e12:.3f} TFLOP on the fullest rank per step)",
        "",
        f"{'pp rank':<8}{'stages':<10}{'blocks':<10}{'params':>14}{'grads':>14}{'optimizer':>14}"
        f"{'in flight':>14}{'peak':>14}{'sent':>14}",
    ]
    for st in f["stages"]:
        lines.append(
            f"{st['pp_rank']:<8}{','.join(map(str, st['stages'])):<10}{','.join(map(str, st['blocks'])):<10}"
            f"{_gib(st['params']):>14}{_gib(st['grads']):>14}{_gib(st['optimizer']):>14}"
            f"{_gib(st['activations']):>14}{_gib(st['peak']):>14}{_gib(st['send_bytes']):>14}"
        )
    lines += [
        "  (in flight: what the step adds at its peak: the activations the schedule holds at once, gathered",
        "  parameters, receive buffers; sent: hidden states forward and their gradients back, per step)",
        "",
        "communication of the fullest rank per step (counted; point-to-point from the cut)",
        f"{'collective':<16}{'axes':<6}{'phase':<10}{'count':>7}{'logical':>14}{'on wire':>14}",
    ]
    for c in sorted(p.comm, key=lambda c: (c.axes, ("forward", "backward", "optimizer").index(c.phase), c.kind)):
        lines.append(
            f"{c.kind:<16}{','.join(c.axes):<6}{c.phase:<10}{c.count:>7}{_gib(c.bytes):>14}{_gib(c.wire_bytes):>14}"
        )
    lines.append(f"{'total on wire':<39}{_gib(p.comm_bytes()):>28}")
    return "\n".join(lines)
