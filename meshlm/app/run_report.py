"""What a training run reports about its layout and memory: the layout in effect on this
run's mesh (NOTE [effective sharding] in meshlm/layout/effective.py), what ``meshlm plan`` predicts
for the run, and the memory part of the final line."""

from __future__ import annotations

from typing import Any, Optional

from meshlm.layout.offload import KINDS


def fmt_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f}GiB"
    return f"{n / 2**20:.0f}MiB" if n >= 10 * 2**20 else f"{n / 2**20:.2f}MiB"


def effective_layout(cfg, layout, resolved: dict[str, int]):
    """The layout on this run's mesh (NOTE [effective sharding] in meshlm/layout/effective.py)."""
    from meshlm.core.axes import MESH_AXES
    from meshlm.layout.effective import check

    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    sizes.update(resolved)
    return check(layout, sizes, cfg.layout.strict)


def planned_memory(cfg, layout: str, sizes: dict[str, int]) -> Optional[dict[str, int]]:
    """What ``meshlm plan`` predicts for this run, per rank on its device: params, grads,
    optimizer and the total (model state, held activations and gathered copies), less what
    the run's offload moves off the device (NOTE [planned offload] in meshlm/plan/offload.py;
    on a CPU run ``host`` is the device's own memory and moves nothing, so it stays); None
    where it cannot (a model loaded from Hugging Face weights, a model other than the
    shipped Llama)."""
    if cfg.model.init_from or not cfg.model.is_llama():
        return None
    from meshlm.app.plan import formula_plan, from_run_config

    kw, spec = from_run_config(cfg), run_offload(cfg, layout)
    p = formula_plan(dict(kw, offload=spec), layout, sizes)
    return {k: int(p.memory[k]) for k in ("params", "grads", "optimizer", "total")}


def run_offload(cfg, layout: str):
    """The run's offload tiers (``meshlm.app.config.offload_spec``) as they act on the run's
    device: ``host`` is ``device`` where that is the CPU (NOTE [swapped storage] in
    meshlm/runtime/offload/store.py)."""
    import dataclasses

    import torch

    from meshlm.app.config import offload_spec
    from meshlm.layout.rules import load_layout

    spec = offload_spec(cfg, load_layout(layout))
    t = cfg.train
    on_cpu = not (t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()))
    if on_cpu:
        spec = dataclasses.replace(spec, **{k: "device" for k in KINDS if getattr(spec, k) == "host"})
    return spec


def memory_line(s: dict[str, Any]) -> str:
    """Memory by kind for the final line: measured (planned)."""
    parts = []
    for k in ("params", "grads", "optimizer", "peak"):
        m = s.get(f"mem_{k}_bytes")
        p = s.get(f"planned_{'total' if k == 'peak' else k}_bytes")
        if m is not None:
            parts.append(f"{k} {fmt_bytes(m)}" + (f" (planned {fmt_bytes(p)})" if p is not None else ""))
    return ", ".join(parts + [f"RSS {fmt_bytes(s['rss_bytes_per_rank'])}"]) + build_note(s)


# How the model was built (NOTE [model build] in meshlm/app/model_plain.py), for the memory line.
BUILDS = {
    "meta": "built on meta, initialised shard by shard",
    "host": "built whole on the host from train.seed, then sliced",
    "init_from": "loaded from model.init_from",
}


def build_note(s: dict[str, Any]) -> str:
    """``"; model built whole on the host ... (<bytes> whole, one copy per host while
    building)"`` after a plain model's build, the one that costs a whole copy per host; ""
    after the others (meta, init_from), which ``summary.json``'s ``build`` still records."""
    how = s.get("build")
    if how != "host":
        return ""
    n = s.get("build_bytes")
    size = f" ({fmt_bytes(n)} whole{', one copy per host while building' if how == 'host' else ''})" if n else ""
    return f"; model {BUILDS[how]}{size}"


def gather_memory(mem_kinds: dict, device, world: int) -> dict[str, Any]:
    """Memory of the fullest rank, by kind (NOTE [run memory] in meshlm/train/metrics.py; None: not
    measured), and the process's resident set (CPU) or allocator peak (CUDA) over the run:
    one all-reduce (max) over the job."""
    import torch
    import torch.distributed as dist

    from meshlm.train.metrics import peak_memory_bytes

    kinds = ("params", "grads", "optimizer", "peak")
    vals = [mem_kinds.get(k) for k in kinds] + [peak_memory_bytes(device)]
    peak = torch.tensor([-1 if v is None else v for v in vals], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out: dict[str, Any] = {f"mem_{k}_bytes": (int(v) if v >= 0 else None) for k, v in zip(kinds, peak.tolist()[:4])}
    out["rss_bytes_per_rank"] = int(peak[4].item())
    return out


def done_line(summary: dict[str, Any], steps_line: str, run_dir) -> str:
    """The final line of a run that was not stopped by a signal."""
    tp = summary["tokens_per_s"]  # None: no step was timed (the first and the memory-measuring one are not)
    rate = f"{tp:,.0f} tokens/s" if tp else "tokens/s not timed (too few steps)"
    first, last, val = summary["first_train_loss"], summary["final_train_loss"], summary["final_val_loss"]
    return (
        f"done: {steps_line} in {summary['wall_s']:.0f}s; loss {first:.3f} -> {last:.3f}, val_loss {val:.3f}; "
        f"{rate}; memory/rank {memory_line(summary)}; outputs in {run_dir}"
    )


def run_summary(
    cfg,
    *,
    layout_name,
    world,
    start,
    step,
    life,
    eff,
    skipped,
    rates,
    memory,
    planned,
    comm_bytes,
    losses,
    wall,
    startup,
    checkpointed,
    build=None,
) -> dict[str, Any]:
    """summary.json of a run: what ran (layout, mesh, model, steps), how fast (the median
    tokens/s of the timed steps: robust to noisy neighbours), memory by kind measured
    (``gather_memory``) and planned, bytes per step, the losses (first, last, validation)."""
    t = cfg.train
    rates = sorted(rates)
    first, last, val = losses
    return {
        "layout": layout_name,
        "mesh": str(cfg.mesh),
        "model": cfg.model.label,
        "world_size": world,
        "steps": t.steps,
        "start_step": start,
        "steps_run": step - start,
        "global_step": step,
        "run_id": life.run_id,
        "stopped_by": life.stop_name,
        "skipped_steps": skipped,
        "tokens_per_s": rates[len(rates) // 2] if rates else None,
        "layout_effective": eff.label(),
        "layout_warnings": eff.problems(),
        "grad_accum": t.grad_accum,
        "tokens_per_step": t.batch_size * t.seq_len,
        **memory,
        **{f"planned_{k}_bytes": v for k, v in (planned or {}).items()},
        "comm_bytes_per_step": comm_bytes,
        "first_train_loss": first,
        "final_train_loss": last,
        "final_val_loss": val,
        "wall_s": wall,
        "startup_s": startup,
        "activation_checkpointed_blocks": checkpointed,
        "build": (build or {}).get("how"),  # NOTE [model build] in meshlm/app/model_plain.py
        "build_bytes": (build or {}).get("bytes"),
    }
