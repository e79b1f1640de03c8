"""What a benchmark records about the run around its figures: the machine's load before and
after (``uptime``'s 1, 5 and 15 minute averages; the machine is shared) and the commit measured."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"


def profile_step(step) -> tuple:
    """(seconds, cProfile's 25 costliest functions by own time) of one call of ``step``."""
    import cProfile
    import io
    import pstats
    import time

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    step()
    prof.disable()
    t = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return t, text.getvalue()


def run_and_write(name: str, bench, opts: dict, render, argv, **extra) -> int:
    """Run ``bench(opts)`` on a pool of 4 ranks, then write ``<out>/<name>.json`` (rank 0's
    results with the run's meta: options, date, machine, torch, commit, load before and
    after, the command) and ``<out>/<name>.md`` (``render(results, meta)``), and print it."""
    import datetime
    import json
    import sys

    import torch

    from harness import DistPool

    load_before = load()
    with DistPool(4, timeout_s=300, job_timeout_s=3600) as pool:
        results = pool.run(bench, opts)[0]
    meta = dict(
        opts,
        **extra,
        date=datetime.date.today().isoformat(),
        machine=machine(),
        torch=torch.__version__,
        commit=commit(),
        load_before=load_before,
        load_after=load(),
        command=f"python benchmarks/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    out = Path(opts["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    text = render(results, meta)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0
