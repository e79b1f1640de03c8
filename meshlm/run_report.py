"""What a training run reports about its layout and memory: the layout in effect on this
run's mesh (NOTE [effective sharding] in meshlm/effective.py), what ``meshlm plan`` predicts
for the run, and the memory part of the final line."""

from __future__ import annotations

from typing import Any, Optional


def fmt_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f}GiB"
    return f"{n / 2**20:.0f}MiB" if n >= 10 * 2**20 else f"{n / 2**20:.2f}MiB"


def effective_layout(cfg, layout, resolved: dict[str, int]):
    """The layout on this run's mesh (NOTE [effective sharding] in meshlm/effective.py)."""
    from meshlm.axes import MESH_AXES
    from meshlm.effective import check

    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    sizes.update(resolved)
    return check(layout, sizes, cfg.layout.strict)


def planned_memory(cfg, layout: str, sizes: dict[str, int]) -> Optional[dict[str, int]]:
    """What ``meshlm plan`` predicts for this run, per rank: params, grads, optimizer and the
    total (model state, held activations and gathered copies); None where it cannot (a model
    loaded from Hugging Face weights, a model other than the shipped Llama)."""
    if cfg.model.init_from or not cfg.model.is_llama():
        return None
    from meshlm.plan.main import _from_run_config, formula_plan

    p = formula_plan(_from_run_config(cfg), layout, sizes)
    return {k: int(p.memory[k]) for k in ("params", "grads", "optimizer", "total")}


def memory_line(s: dict[str, Any]) -> str:
    """Memory by kind for the final line: measured (planned)."""
    parts = []
    for k in ("params", "grads", "optimizer", "peak"):
        m = s.get(f"mem_{k}_bytes")
        p = s.get(f"planned_{'total' if k == 'peak' else k}_bytes")
        if m is not None:
            parts.append(f"{k} {fmt_bytes(m)}" + (f" (planned {fmt_bytes(p)})" if p is not None else ""))
    return ", ".join(parts + [f"RSS {fmt_bytes(s['rss_bytes_per_rank'])}"])
