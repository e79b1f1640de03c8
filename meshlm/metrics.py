"""Per-step measurements and the run's metrics files: peak memory, ``metrics.jsonl``,
the loss-curve PNG and a sweep's summary table and plot.  (Collective bytes: meshlm.comm.)"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, Optional

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: CUDA allocator's max allocated bytes on GPU,
    resident set size high-water mark (``ru_maxrss``) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class MetricsWriter:
    """``metrics.jsonl`` in the run directory: one JSON object per line (rank 0 only)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self._f.close()


def read_metrics(path: "str | os.PathLike") -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(rows: list[dict[str, Any]], path: "str | os.PathLike", title: str = "") -> None:
    """A loss-curve PNG: train loss per step, validation loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SUMMARY_COLUMNS = ("run", "layout", "mesh", "model", "steps", "tokens_per_s", "peak_mem_bytes_per_rank",
                   "comm_bytes_per_step", "final_train_loss", "final_val_loss", "wall_s")


def summarize_sweep(sweep_dir: "str | os.PathLike") -> Optional[Path]:
    """Scan a multirun directory for runs' ``summary.json`` and write ``summary.md``,
    ``summary.csv`` and ``summary.png`` (one row / bar group per run) there."""
    import csv

    sweep = Path(sweep_dir)
    rows = []
    for p in sorted(sweep.glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        with open(p) as f:
            s = json.load(f)
        s["run"] = p.parent.name
        rows.append(s)
    if not rows:
        return None
    with open(sweep / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)

    def fmt(v: Any, k: str) -> str:
        if v is None:
            return "-"
        if k in ("peak_mem_bytes_per_rank", "comm_bytes_per_step"):
            return f"{v / 2**20:.1f} MiB"
        if isinstance(v, float):
            return f"{v:.4f}" if "loss" in k else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k), k) for k in SUMMARY_COLUMNS) + " |")
    (sweep / "summary.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.get('layout')}\n{r.get('mesh')}" for r in rows]
    panels = [("tokens_per_s", "tokens/s", 1), ("peak_mem_bytes_per_rank", "peak mem / rank (MiB)", 2**20),
              ("comm_bytes_per_step", "comm / rank / step (MiB)", 2**20), ("final_train_loss", "final train loss", 1),
              ("final_val_loss", "final val loss", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (k, title, scale) in zip(axes, panels):
        vals = [(r.get(k) or 0) / scale for r in rows]
        ax.bar(range(len(rows)), vals, color="tab:blue")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(sweep / "summary.png", dpi=100)
    plt.close(fig)
    return sweep / "summary.md"
