"""The figures of a sweep's summary (:mod:`meshlm.app.sweep`): bars per run, and every run's
loss curves on one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 2**20


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curve_rows(run: dict[str, Any]) -> list[dict]:
    from meshlm.train.metrics import read_metrics

    p = Path(run["dir"]) / "metrics.jsonl"
    if not p.exists():
        return []
    rows = [r for r in read_metrics(p) if "step" in r]
    per_step = run.get("tokens_per_step")
    for r in rows:  # metrics written before tokens and wall_s were recorded
        if r.get("tokens") is None and per_step:
            r["tokens"] = r["step"] * per_step
    return rows


def curves_figure(runs: list[dict[str, Any]]):
    """Train loss (lines) and validation loss (markers, same colour) of every run against
    step, tokens and wall time: one line per run and panel."""
    plt = _plt()
    xs = (("step", "step"), ("tokens", "tokens"), ("steady_s", "wall time after the first step (s)"))
    fig, axes = plt.subplots(1, len(xs), figsize=(5 * len(xs), 4), squeeze=False)
    for n, run in enumerate(runs):
        rows = _curve_rows(run)
        t1 = next((r["wall_s"] for r in rows if r.get("wall_s") is not None), None)
        for r in rows:  # from the end of the first step: start-up and compilation left out
            r["steady_s"] = None if t1 is None or r.get("wall_s") is None else r["wall_s"] - t1
        color = f"C{n % 10}"
        for ax, (key, _title) in zip(axes[0], xs):
            tr = [(r[key], r["loss"]) for r in rows if r.get("loss") is not None and r.get(key) is not None]
            va = [(r[key], r["val_loss"]) for r in rows if r.get("val_loss") is not None and r.get(key) is not None]
            if tr:
                ax.plot(*zip(*tr), color=color, lw=1, label=run["run"])
            if va:
                ax.plot(*zip(*va), "o", color=color, ms=4, label="_nolegend_")
    for ax, (_key, title) in zip(axes[0], xs):
        ax.set_xlabel(title)
        ax.set_ylabel("loss (lines: train, dots: validation)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def bar_label(run: dict[str, Any]) -> str:
    """A bar's label: the run, and the layout as it ran where that says more (``tp (runs
    as: data parallel over fsdp=4)``), as the table does."""
    import textwrap

    label = run["run"].replace(",", ", ") + (" (failed)" if run.get("error") else "")
    eff = run.get("layout_effective")
    if eff and eff != run.get("layout"):
        label += "\n" + eff.replace(" (runs as: ", "\n(runs as: ")
    return "\n".join(textwrap.fill(line, 26) for line in label.split("\n"))


def bars_figure(runs: list[dict[str, Any]]):
    """Per run, labelled with the layout as it ran: tokens/s, memory per rank stacked by
    kind (measured; planned model state and planned total as markers), communication per
    step, final losses, and wall time stacked as start-up (to the end of the first step,
    compilation included) and steady steps (NOTE [start-up and steady steps] in
    meshlm/app/sweep.py)."""
    plt = _plt()
    labels = [bar_label(r) for r in runs]
    idx = range(len(runs))
    fig, axes = plt.subplots(1, 5, figsize=(4 + 3.6 * max(5, len(runs)), 6.5))

    def bar(ax, key, title, scale=1):
        ax.bar(idx, [(r.get(key) or 0) / scale for r in runs], color="tab:blue")
        ax.set_title(title, fontsize=9)

    bar(axes[0], "tokens_per_s", "tokens/s")
    ax = axes[1]
    bottom = [0.0] * len(runs)
    for kind, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        vals = [(r.get(f"mem_{kind}_bytes") or 0) / MiB for r in runs]
        ax.bar(idx, vals, bottom=bottom, color=color, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [
        max(0.0, (r.get("mem_peak_bytes") or 0) / MiB - b) if r.get("mem_peak_bytes") else 0
        for r, b in zip(runs, bottom)
    ]
    ax.bar(idx, rest, bottom=bottom, color="tab:gray", alpha=0.5, label="rest of the peak")
    for key, marker, name in (
        ("planned_state_bytes", "_", "planned model state"),
        ("planned_total_bytes", "x", "planned total"),
    ):
        pts = [(i, r[key] / MiB) for i, r in zip(idx, runs) if r.get(key) is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color="k", s=120, label=name, zorder=3)
    ax.set_title("memory / rank (MiB)", fontsize=9)
    ax.legend(fontsize=7)
    bar(axes[2], "comm_bytes_per_step", "comm / rank / step (MiB)", MiB)
    ax = axes[3]
    w = 0.4
    ax.bar([i - w / 2 for i in idx], [r.get("final_train_loss") or 0 for r in runs], w, label="train")
    ax.bar([i + w / 2 for i in idx], [r.get("final_val_loss") or 0 for r in runs], w, label="validation")
    ax.set_title("final loss", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[4]
    up = [r.get("startup_total_s") or 0 for r in runs]
    ax.bar(idx, up, color="tab:orange", label="start-up and first step (compile)")
    ax.bar(idx, [r.get("steady_s") or 0 for r in runs], bottom=up, color="tab:blue", label="steady steps")
    ax.set_title("wall time (s)", fontsize=9)
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(list(idx))
        ax.set_xticklabels(labels, fontsize=6, rotation=90, va="top")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
