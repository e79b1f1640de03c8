"""The memory picture of the candidates (``layout=auto``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from meshlm.plan.report import GiB, Plan, _mesh_str, _parts


def _plot(plans: list[Plan], path: str, cap: Optional[float] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(plans)), 4))
    labels = [f"{p.layout}\n" + _mesh_str(p.mesh).replace(",", "\n") for p in plans]
    bottom = [0.0] * len(plans)
    parts = [_parts(p) for p in plans]
    for key in ("params", "grads", "optimizer", "activations", "gathered", "recompute"):
        vals = [d.get(key, 0) / GiB for d in parts]
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
