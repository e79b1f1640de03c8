"""The sweep's picture tells the truth (NOTE [start-up and steady steps] in meshlm/app/sweep.py):
bars labelled with the layout as it ran, wall time split into start-up (the first step's
compile included) and steady steps, and loss against the steady steps' wall time.  Two
jobs written as ``meshlm train`` writes them: ``tp`` compiles for 20 s in its first step
and then steps in 0.5 s; ``ddp`` on a mesh where ``tp`` would degenerate starts in 2 s and
steps in 1 s."""

from __future__ import annotations

import csv
import json

from meshlm.app.sweep import runs, summarize_sweep
from meshlm.app.sweep_plots import bars_figure, curves_figure


def _job(root, num, layout, eff, startup, step_s):
    d = root / f"{num}_layout={layout}"
    d.mkdir()
    (d / "job.json").write_text(json.dumps({"num": num, "overrides": [f"layout={layout}"]}))
    first = startup["first_step"]
    rows = [{"step": s, "loss": 5.0 - s, "wall_s": first + (s - 1) * step_s} for s in range(1, 6)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"layout": layout, "layout_effective": eff, "wall_s": rows[-1]["wall_s"], "startup_s": startup,
               "tokens_per_s": 1000 / step_s, "final_train_loss": 0.0}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))


def test_bars_and_curves_tell_the_truth(tmp_path):
    _job(tmp_path, 0, "tp", "tp", {"launch": 3.0, "build": 1.0, "first_step": 20.0}, 0.5)
    _job(tmp_path, 1, "fsdp_tp", "fsdp_tp (runs as: tensor parallel over tp=2)", {"build": 1.0, "first_step": 1.0}, 1.0)
    rs = runs(tmp_path)
    assert [(r["startup_total_s"], r["steady_s"]) for r in rs] == [(24.0, 2.0), (2.0, 4.0)]
    fig = bars_figure(rs)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[0] == "layout=tp" and labels[1].startswith("layout=fsdp_tp\nfsdp_tp\n(runs as: tensor")
    wall = fig.axes[4]
    assert wall.get_title() == "wall time (s)"
    heights = [round(p.get_height(), 3) for p in wall.patches]
    assert heights == [24.0, 2.0, 2.0, 4.0]  # start-up bars, then the steady ones stacked on them
    curves = curves_figure(rs)
    x = [list(line.get_xdata()) for line in curves.axes[2].get_lines()]
    assert x == [[0.0, 0.5, 1.0, 1.5, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]]  # tp finishes its steps first
    summarize_sweep(tmp_path)
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["startup_total_s"], r["steady_s"]) for r in table] == [("24.0", "2.0"), ("2.0", "4.0")]
