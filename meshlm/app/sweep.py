"""A sweep's summary: one row per job, in job order, labelled by what the sweep varies.

``meshlm train -m layout=ddp,fsdp,tp ...`` runs one job per combination (a Hydra
multirun).  Each job's directory holds ``job.json`` (its number, its overrides and, if it
failed, its error in one line) and, if it ran, ``summary.json`` and ``metrics.jsonl``.
:func:`summarize_sweep` writes, in the sweep directory:

- ``summary.md`` and ``summary.csv``: the same columns (:data:`COLUMNS`): the run's label
  (the overrides the sweep varies, nothing else), the layout as it ran on the mesh (NOTE
  [effective sharding] in meshlm/layout/effective.py), tokens/s, memory by kind per rank, measured
  and planned (NOTE [run memory] in meshlm/train/metrics.py), communication per step, final
  losses, wall time split into start-up (to the end of the first step, compilation
  included) and steady steps (NOTE [start-up and steady steps]), and the error of a job
  that failed;
- ``summary.png``: per run, labelled with the layout as it ran: tokens/s, memory stacked by
  kind beside the plan, bytes per step, final losses and wall time stacked as start-up and
  steady steps;
- ``curves.png``: train (lines) and validation (markers) loss of every run on one figure,
  against step, tokens and the wall time of the steady steps (from the end of the first).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Optional

MiB = 2**20
KINDS = ("params", "grads", "optimizer")
#: (key, header, unit, planned key): the summary's columns.  summary.csv has one column per
#: key and per planned key, raw numbers; summary.md shows bytes in MiB, "measured / planned".
COLUMNS = (
    ("run", "run", None, None),
    ("layout_effective", "layout (as run)", None, None),
    ("mesh", "mesh", None, None),
    ("tokens_per_s", "tokens/s", None, None),
    ("mem_params_bytes", "params", MiB, "planned_params_bytes"),
    ("mem_grads_bytes", "grads", MiB, "planned_grads_bytes"),
    ("mem_optimizer_bytes", "optimizer", MiB, "planned_optimizer_bytes"),
    ("mem_state_bytes", "model state", MiB, "planned_state_bytes"),
    ("mem_peak_bytes", "peak", MiB, "planned_total_bytes"),
    ("comm_bytes_per_step", "comm/step", MiB, None),
    ("final_train_loss", "train loss", None, None),
    ("final_val_loss", "val loss", None, None),
    ("startup_total_s", "start-up s", None, None),
    ("steady_s", "steady s", None, None),
    ("wall_s", "wall s", None, None),
    ("rss_bytes_per_rank", "RSS (process)", MiB, None),
    ("error", "error", None, None),
)


def _read(p: Path) -> Optional[dict]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _job_num(d: Path, job: dict) -> int:
    if "num" in job:
        return int(job["num"])
    head = d.name.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def runs(sweep_dir: "str | os.PathLike") -> list[dict[str, Any]]:
    """Every job of the sweep in job order: its ``summary.json`` merged with ``job.json``,
    ``run`` set to its label and ``dir`` to its directory."""
    out = []
    for d in Path(sweep_dir).iterdir():
        if not d.is_dir():
            continue
        job, summ = _read(d / "job.json"), _read(d / "summary.json")
        if job is None and summ is None:
            continue
        row = {**(summ or {}), **(job or {}), "dir": str(d)}
        row["num"] = _job_num(d, job or {})
        if summ is None and "error" not in row:
            row["error"] = "no summary.json: the job did not finish"
        state = [row.get(f"mem_{k}_bytes") for k in KINDS]
        row["mem_state_bytes"] = sum(state) if all(v is not None for v in state) else None
        planned = [row.get(f"planned_{k}_bytes") for k in KINDS]
        row["planned_state_bytes"] = sum(planned) if all(v is not None for v in planned) else None
        row.update(wall_split(row))
        out.append(row)
    out.sort(key=lambda r: r["num"])
    _label(out)
    return out


def wall_split(summary: dict) -> dict[str, Optional[float]]:
    """NOTE [start-up and steady steps]
    A run's wall time in two: ``startup_total_s``, from the launch to the end of the first
    step (processes, imports, the process group, the model's build, the first step with
    any compilation and warm-up: summary.json's ``startup_s``), and ``steady_s``, the steps
    after the first (``wall_s`` less the first step).  A layout whose first step compiles
    for 20 s is then not taken for the slowest, when its steady steps are the fastest."""
    st = summary.get("startup_s") or {}
    wall = summary.get("wall_s")
    if not st or wall is None:
        return {"startup_total_s": None, "steady_s": None}
    return {
        "startup_total_s": round(sum(st.values()), 3),
        "steady_s": round(max(0.0, wall - st.get("first_step", 0.0)), 3),
    }


def _label(rows: list[dict]) -> None:
    """``run``: the ``key=value`` overrides whose value differs between the jobs."""
    parsed = [dict(o.split("=", 1) for o in r.get("overrides", []) if "=" in o) for r in rows]
    keys = sorted({k for p in parsed for k in p})
    vary = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    for r, p in zip(rows, parsed):
        label = ",".join(f"{k}={p[k]}" for k in vary if k in p)
        r["run"] = label or (f"job {r['num']}" if r.get("overrides") is not None else Path(r["dir"]).name)


def _fmt(v: Any, unit: Optional[int], key: str) -> str:
    if v is None or v == "":
        return "-"
    if unit:
        return f"{v / unit:.2f}"
    if isinstance(v, float):
        return f"{v:.4f}" if "loss" in key else f"{v:.1f}"
    return str(v).replace("|", "/")


def summarize_sweep(sweep_dir: "str | os.PathLike") -> Optional[Path]:
    """Write ``summary.md``, ``summary.csv``, ``summary.png`` and ``curves.png`` in the
    sweep directory (module docstring); None if it holds no job."""
    sweep = Path(sweep_dir)
    rows = runs(sweep)
    if not rows:
        return None
    keys = [k for c in COLUMNS for k in (c[0], c[3]) if k]
    with open(sweep / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for r in rows:
            w.writerow(["" if r.get(k) is None else r.get(k) for k in keys])
    heads = [h + (" MiB" if u else "") + (" (measured / planned)" if pk else "") for _k, h, u, pk in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [_fmt(r.get(k), u, k) + (f" / {_fmt(r.get(pk), u, pk)}" if pk else "") for k, _h, u, pk in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['run']}: {w}" for r in rows for w in r.get("layout_warnings") or []]
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\nWarnings:\n\n" + "\n".join(notes) + "\n"
    (sweep / "summary.md").write_text(text)
    from meshlm.app.sweep_plots import bars_figure, curves_figure

    for name, fig in (("summary.png", bars_figure(rows)), ("curves.png", curves_figure(rows))):
        fig.savefig(sweep / name, dpi=100)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return sweep / "summary.md"
