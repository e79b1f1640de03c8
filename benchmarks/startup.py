"""Where the start-up of a tiny ``meshlm train`` goes (docs/train.md, "Start-up time").

    python benchmarks/startup.py [--repeat 3] [key=value ...]

Runs ``meshlm train`` (llama_tiny, 10 steps, ``mesh=fsdp2_tp2`` by default) ``--repeat``
times and prints the median and each run's seconds: the wall time of the whole command;
the phases rank 0 reports in ``summary.json`` (``startup_s``, meshlm/train/lifecycle.py
``StartupClock``); the training after the first step; and the rest (the launcher's own
start: Python, Hydra, config; and the end of the run: validation, summary, loss plot,
exit).  ``MESHLM_START_METHOD=spawn`` measures the previous way of starting
workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "model=llama_tiny",
    "layout=fsdp_tp",
    "mesh=fsdp2_tp2",
    "train.steps=10",
    "train.val_every=0",
    "train.val_batches=1",
    "train.progress=false",
]


def one(overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "meshlm.app.cli", "train", *RUN, *overrides, f"hydra.run.dir={d}"],
            cwd=d,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.time() - t0
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        s = json.loads((Path(d) / "summary.json").read_text())
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    phases = s["startup_s"]
    out = {"wall": wall}
    worker_total = sum(phases.values())
    out.update({f"worker {k}": v for k, v in phases.items()})
    out["train after step 1"] = sum(r["step_time_s"] for r in rows[1:])
    # the rest: the launcher's own start (Python, Hydra, config), and the end of the run
    # (validation, summary, loss plot, process exit)
    out["launcher start + end"] = wall - worker_total - out["train after step 1"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    a, overrides = p.parse_known_args()
    runs = [one(overrides) for _ in range(a.repeat)]
    print(
        f"meshlm train {' '.join(RUN + overrides)}  (start method: {os.environ.get('MESHLM_START_METHOD', 'default')}, "
        f"{os.cpu_count()} CPUs, median of {a.repeat})"
    )
    for k in runs[0]:
        vals = [r[k] for r in runs]
        print(f"  {k:<24} {statistics.median(vals):7.2f} s   ({', '.join(f'{v:.2f}' for v in vals)})")


if __name__ == "__main__":
    main()
