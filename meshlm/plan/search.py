"""``layout=auto``: every shipped layout on every (dp, fsdp, tp) factorisation of the
devices (the cp layouts on (dp, fsdp, tp, cp) when nothing else fits: NOTE [cp candidates]),
planned, timed by the cost model and ranked under a memory limit."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from meshlm.core.errors import ConfigError, MeshlmError
from meshlm.layout.offload import resolve_offload
from meshlm.layout.rules import is_pipelined, load_layout, shipped_layouts
from meshlm.models import LlamaConfig
from meshlm.plan.analytic import plan
from meshlm.plan.hardware import Hardware, hardware_profile
from meshlm.plan.offload import offload_seconds, optimizer_host
from meshlm.plan.plot import _plot
from meshlm.plan.report import GiB, Plan, _mesh_str, _parts
from meshlm.plan.state import model_config
from meshlm.plan.where import Unmeasurable


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


def step_time(p: Plan, cfg: "LlamaConfig | None", hw: Hardware, overlap: bool = True) -> dict[str, float]:
    """Cost model (docs/plan.md): compute = the FLOPs a measured plan counted, else
    (6·Ψ_non-emb + 12·L·h·s)·tokens FLOPs (x4/3 for
    the blocks under full activation checkpointing: one more forward) over the per-device
    share at peak·MFU; communication = each collective's ring wire bytes over the
    bandwidth of the link its axis crosses (the innermost axes that fit in a node use the
    intra-node link, the rest the inter-node one); step = max of the two when they overlap,
    else their sum.  A pipeline's compute is its fullest rank's over (1 - the schedule's
    bubble), point-to-point sends included in the communication.  Offloaded state adds, not
    overlapped, its traffic over the profile's host or disk bandwidth (``offload_s``)."""
    tokens = p.global_batch * p.seq
    if "flops" in p.formulas:  # measured (NOTE [fake measurement]): this rank's, recompute included
        flops = p.formulas["flops"]
    else:
        block = 6 * (cfg.num_params(embedding=False) - cfg.embed) + 12 * cfg.layers * cfg.embed * p.seq
        if p.activation_checkpointing == "full":
            block *= 4 / 3
        flops = (block + 6 * cfg.embed) * tokens / p.world_size
    t_comp = flops / (hw.peak_flops * hw.mfu)
    if "bubble" in p.formulas:  # a pipeline: this rank's compute spread over the schedule's step
        t_comp /= 1.0 - p.formulas["bubble"]
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
    t_off = offload_seconds(p, hw)  # not overlapped (NOTE [planned offload])
    total += t_off
    out = {"compute_s": t_comp, "comm_s": t_comm, "step_s": total, "tokens_per_s": tokens / total if total else 0.0}
    return dict(out, offload_s=t_off) if t_off else out


# The order candidates are tried in: of two that plan identically (hsdp with dp=1 is fsdp,
# fsdp_tp with tp=1 is fsdp), the earlier name is kept.
PREFERENCE = (
    "single",
    "ddp",
    "zero1",
    "zero2",
    "fsdp",
    "hsdp",
    "tp",
    "tp_sp",
    "fsdp_tp",
    "fsdp_tp_sp",
    "pp",
    "fsdp_pp",
    "fsdp_tp_pp",
)


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
        raise ConfigError(
            f"plan.max_memory_per_device={v!r}: write a size like 80GiB, 141GB or 512MiB (a bare number is GiB)"
        ) from None


@dataclass
class Candidate:
    plan: Plan
    time: dict[str, float]


def candidates(
    model: "str | LlamaConfig",
    devices: int,
    *,
    global_batch: int,
    seq: int,
    activation_checkpointing: str = "none",
    param_dtype: str = "float32",
    master_dtype: Optional[str] = None,
    grad_accum: int = 1,
    hardware: "str | Hardware" = "h100_nvlink_ib",
    overlap: bool = True,
    layouts: Optional[list[str]] = None,
    compute_dtype: str | None = None,
    reduce_dtype: str | None = None,
    planner: Optional[Callable[[str, dict], Plan]] = None,
    offload: "Mapping[str, Any] | None" = None,
    device_is_host: bool = False,
    replan: bool = False,
    context: bool = False,
) -> list[Candidate]:
    """Every shipped layout on every factorisation of ``devices`` into (dp, fsdp, tp), and
    (dp, fsdp, tp, pp > 1) for a pipeline layout with the measured planner, that
    applies (dims divide, the batch splits, every axis of size > 1 is one the layout uses),
    planned and timed; duplicates (identical plans) dropped, keeping the PREFERENCE order.
    ``planner(layout, mesh) -> Plan`` plans each (``meshlm plan``: the measured planner);
    None: the analytic :func:`plan` of ``model``.  ``offload``: the run's ``offload.*``
    settings over each layout's own section (NOTE [planned offload]); with ``replan``,
    ``planner`` is called as ``planner(layout, mesh, offload)`` (``layout=auto`` planning
    again with ``offload.optimizer=host``).  ``context``: the context-parallel layouts instead
    (``seq`` over cp), on (dp, fsdp, tp, cp > 1): what ``choose_layout`` tries when nothing
    else fits (NOTE [cp candidates])."""
    hw = hardware if isinstance(hardware, Hardware) else hardware_profile(hardware)
    name, mcfg = model_config(model)
    names = layouts or sorted(shipped_layouts(), key=lambda n: (PREFERENCE.index(n) if n in PREFERENCE else 99, n))
    out, seen, unmeasured = [], set(), None
    for lay in names:
        piped = is_pipelined(load_layout(lay))
        if (piped or load_layout(lay).scopes) and planner is None:  # the analytic planner models neither
            continue  # pipeline stages nor scopes (NOTE [scoped layouts] in meshlm/core/scopes.py)
        used = load_layout(lay).mesh_axes_used()
        if "ep" in used or ("cp" in used) != context or (piped and "cp" in used):
            continue  # the search does not factor ep, nor cp with pp, yet; cp only when asked (NOTE [cp candidates])
        axes = (
            ("dp", "fsdp", "tp", "pp") if piped else (("dp", "fsdp", "tp", "cp") if context else ("dp", "fsdp", "tp"))
        )
        # dp largest first: of two meshes that plan alike (ddp over dp or over fsdp), the
        # plain data-parallel one is kept
        for m in sorted(factorisations(devices, axes), key=lambda m: -m["dp"]):
            if (piped and m["pp"] < 2) or (context and m["cp"] < 2):
                continue  # the layout without pp (cp) is another candidate
            if any(sz > 1 and a not in used for a, sz in m.items()):
                continue  # every rank would repeat the same work on that axis
            if devices > 1 and not any(sz > 1 for sz in m.values()):
                continue
            try:
                p = (
                    (planner(lay, m, offload) if replan else planner(lay, m))
                    if planner is not None
                    else plan(
                        mcfg,
                        lay,
                        m,
                        global_batch=global_batch,
                        seq=seq,
                        grad_accum=grad_accum,
                        activation_checkpointing=activation_checkpointing,
                        param_dtype=param_dtype,
                        master_dtype=master_dtype,
                        compute_dtype=compute_dtype,
                        reduce_dtype=reduce_dtype,
                        offload=offload,
                        device_is_host=device_is_host,
                    )
                )
            except Unmeasurable as e:  # left out; said if every candidate is (NOTE [unmeasurable step])
                unmeasured = e
                continue
            except MeshlmError:  # a dim does not divide, or the batch does not split
                continue
            p.model = name
            t = step_time(p, mcfg, hw, overlap)
            sig = (
                tuple(sorted(p.memory.items())),
                round(t["step_s"], 12),
                round(t["comm_s"], 12),
                tuple(
                    sorted(
                        (k[0], p.mesh[k[1][0]], k[2], v["count"], v["bytes"])
                        for k, v in p.comm_summary(by_phase=True).items()
                    )
                ),
            )
            if sig in seen:
                continue
            seen.add(sig)
            out.append(Candidate(p, t))
    if not out and unmeasured is not None:  # no candidate could be measured: say why, not "nothing divides"
        raise unmeasured
    return out


def choose_layout(
    *,
    model: "str | LlamaConfig" = "llama_small",
    devices: int = 1,
    max_memory: "float | str | None" = None,
    global_batch: int = 16,
    seq: int = 128,
    activation_checkpointing: str = "none",
    param_dtype: str = "float32",
    master_dtype: Optional[str] = None,
    grad_accum: int = 1,
    hardware: str = "auto",
    overlap: bool = True,
    png: Optional[str] = None,
    out=None,
    top: int = 5,
    compute_dtype: str | None = None,
    reduce_dtype: str | None = None,
    headroom: float = 0.0,
    planner: Optional[Callable[[str, dict], Plan]] = None,
    offload: "Mapping[str, Any] | None" = None,
) -> tuple[str, dict[str, int]]:
    """``layout=auto``: plan every candidate (:func:`candidates`), drop what does not fit
    ``max_memory`` per device (default: the hardware profile's memory) less the
    ``headroom`` fraction kept free, rank the rest (:func:`rank_key`), print a ranked table (and write a PNG of the memory of the shown
    candidates to ``png``), and return the winner's (layout name, mesh sizes).

    Raises :class:`NothingFits` when nothing fits, and then writes no PNG.  From a :class:`meshlm.app.config.RunConfig`:
    :func:`meshlm.app.plan.choose_layout`.

    NOTE [cp candidates]: context parallelism splits each sequence over cp for the whole
    model: the same FLOPs per device as the batch split over fsdp, with the attention's
    exchange on top, so it only pays when activations do not fit otherwise.  The search
    plans the cp layouts (on every (dp, fsdp, tp, cp > 1) factorisation) when no other
    candidate fits, and before offloading the optimizer state.
    """
    out = out or sys.stdout
    hw = hardware_profile(hardware)
    # a bad offload setting stops here, not as every candidate dropped
    resolve_offload(None, dict(offload or {}))
    cap = (parse_memory(max_memory) if max_memory is not None else hw.memory) * (1.0 - headroom)
    kw = dict(
        global_batch=global_batch,
        seq=seq,
        activation_checkpointing=activation_checkpointing,
        param_dtype=param_dtype,
        master_dtype=master_dtype,
        grad_accum=grad_accum,
        hardware=hw,
        overlap=overlap,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        planner=planner,
        device_is_host=hw.name == "cpu",
    )
    rows = candidates(model, devices, **kw, offload=offload)
    fits = sorted((r for r in rows if r.plan.memory["total"] <= cap), key=rank_key)
    extra, note, rows_off = None, None, []
    if not fits:  # NOTE [cp candidates]: the sequence split over cp
        rows_cp = candidates(model, devices, **kw, offload=offload, context=True)
        fits = sorted((r for r in rows_cp if r.plan.memory["total"] <= cap), key=rank_key)
        rows += rows_cp
        if fits:
            note = "nothing fits with whole sequences; context parallel (the sequence split over cp)"
    alt = optimizer_host(offload) if not fits else None
    if alt is not None:  # nothing fits on the device alone: the optimizer state on the host
        rows_off = candidates(model, devices, **kw, offload=alt, replan=True)
        fits = sorted((r for r in rows_off if r.plan.memory["total"] <= cap), key=rank_key)
        if fits:
            extra = {"optimizer": "host"}
            note = "nothing fits on the device alone; with offload.optimizer=host (optimizer state and masters in " + (
                "host memory, which on this profile is the device's: counted as host, as on a GPU)"
                if hw.name == "cpu"
                else "host memory)"
            )
    if png and fits:  # a failed plan draws nothing: its error says what to change instead
        _plot([r.plan for r in fits[:top]], png, cap)
    if not fits:
        off = [r.plan for r in rows_off]
        msg = nothing_fits([r.plan for r in rows], cap, devices, activation_checkpointing, off)
        raise NothingFits(msg + (" (No memory picture written: nothing fits.)" if png else ""))
    n_all = len(rows_off) if extra else (len(rows_cp) if note else len(rows))
    out.write(format_candidates(fits[:top], hw, cap, overlap, n_all, len(fits), headroom, note) + "\n")
    best = fits[0].plan
    return Choice(best.layout, {k: v for k, v in best.mesh.items() if v > 1} or {"dp": 1}, extra)


class Choice(tuple):
    """``layout=auto``'s winner: the pair (layout name, mesh sizes), and ``offload``: the
    offload settings it needs besides the run's (``{"optimizer": "host"}``), None: none."""

    def __new__(cls, layout: str, mesh: dict, offload: Optional[dict] = None):
        self = super().__new__(cls, (layout, mesh))
        self.offload = offload
        return self


def rank_key(r: Candidate) -> tuple:
    """A candidate that keeps every kind of state on the device before one that offloads;
    then the fastest step first; of equal steps, the lower memory, then the less
    communication time (with overlap, a step that compute dominates hides its communication)."""
    offloads = bool((getattr(r.plan, "offload", None) or {}).get("kinds"))
    return (offloads, r.time["step_s"], r.plan.memory["total"], r.time["comm_s"])


def format_candidates(
    rows: list[Candidate],
    hw: Hardware,
    cap: float,
    overlap: bool,
    n_all: int,
    n_fit: int,
    headroom: float = 0.0,
    note: Optional[str] = None,
) -> str:
    """The ranked table; ``note`` goes before the count of those that fit (``layout=auto``
    with ``offload.optimizer=host``: nothing fit on the device alone)."""
    p0 = rows[0].plan
    lines = [
        f"meshlm plan: layout=auto for {p0.model} on {p0.world_size} devices ({hw.name}, "
        f"{cap / GiB:.1f} GiB each{f' after {headroom:.0%} headroom' if headroom else ''}), global batch {p0.global_batch} x seq {p0.seq}: "
        f"{f'{note} ' if note else ''}{n_fit} of {n_all} candidates fit; step = {'max' if overlap else 'sum'}(compute, comm)",
        f"{'rank':<5}{'layout':<12}{'mesh':<20}{'state GiB':>10}{'act GiB':>9}{'total GiB':>10}"
        f"{'compute s':>11}{'comm s':>10}{'step s':>10}{'tok/s/dev':>11}",
    ]
    for i, r in enumerate(rows, 1):
        p, t, m = r.plan, r.time, r.plan.memory
        state = m["params"] + m["grads"] + m["optimizer"]
        act = m["total"] - state
        lines.append(
            f"{i:<5}{p.layout:<12}{_mesh_str(p.mesh):<20}{state / GiB:>10.2f}{act / GiB:>9.2f}"
            f"{m['total'] / GiB:>10.2f}{t['compute_s']:>11.4f}{t['comm_s']:>10.4f}{t['step_s']:>10.4f}"
            f"{t['tokens_per_s'] / p.world_size:>11.0f}"
        )
    if any(r.time.get("offload_s") for r in rows):
        lines.append(
            f"(step s adds moving the offloaded state, not overlapped: {hw.host_bw / 1e9:g} GB/s to host, "
            f"{hw.disk_bw / 1e9:g} GB/s to disk per device)"
        )
    return "\n".join(lines)


def nothing_fits(
    plans: list[Plan], cap: float, devices: int = 0, ac: str = "none", offloaded: Optional[list[Plan]] = None
) -> str:
    """Why nothing fits in ``cap``: the smallest candidate, what dominates it and what to
    change.  ``offloaded``: the same candidates planned with ``offload.optimizer=host``; where
    the optimizer state dominates, the message says how small they get."""
    if not plans:
        return (
            f"no layout applies to this model on {devices} devices: no factorisation into (dp, fsdp, tp) divides "
            "its dims and the batch; change the device count or train.batch_size"
        )
    p = min(plans, key=lambda p: p.memory["total"])
    parts = _parts(p)
    dom = max(parts, key=parts.get)
    if p.formulas.get("activations", {}).get("checkpointing") == "full":
        ac = "full"  # its blocks already keep only their inputs
    advice = {
        "activations": (
            "use smaller micro-batches (train.grad_accum) or shard the sequence (tp_sp, fsdp_tp_sp)"
            if ac == "full"
            else f"turn on activation checkpointing (train.activation_checkpointing="
            f"{'full' if ac == 'selective' else 'selective or full'}), use smaller micro-batches "
            "(train.grad_accum) or shard the sequence (tp_sp, fsdp_tp_sp)"
        ),
        "recompute": "use smaller micro-batches (train.grad_accum) or grow tp",
        "gathered": "grow tp (shards the output head) or add devices",
        "optimizer": "shard the optimizer state over more ranks (more fsdp: zero1/zero2/fsdp layouts) or add devices",
        "params": "shard the parameters (fsdp or tp) over more ranks, or add devices",
        "grads": "shard the gradients (zero2/fsdp) over more ranks, or add devices",
    }[dom]
    msg = (
        f"nothing fits in {cap / GiB:.1f} GiB per device. The smallest any candidate reaches is "
        f"{p.memory['total'] / GiB:.2f} GiB ({p.layout}, {_mesh_str(p.mesh)}), dominated by {dom} "
        f"({parts[dom] / GiB:.2f} GiB): {advice}."
    )
    if dom == "optimizer" and offloaded:
        q = min(offloaded, key=lambda q: q.memory["total"])
        msg += (
            f" With the optimizer state in host memory (offload.optimizer=host) the smallest is "
            f"{q.memory['total'] / GiB:.2f} GiB ({q.layout}, {_mesh_str(q.mesh)})."
        )
    return msg
