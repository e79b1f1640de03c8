"""How much of meshlm's eager data-parallel step, against torch's DDP, is communication.

    python benchmarks/comm_split.py [--steps 2] [--reps 3] [--out DIR]

On one 4-rank gloo pool (llama_small, fp32, AdamW, global batch 8 x seq 128; the builders of
bench_layouts.py), four variants in interleaved rounds, each step timed from a barrier and
reported as the slowest rank's:
  meshlm          meshlm.shard(..., "ddp", dp=4) + ShardedOptimizer
  meshlm_nocomm   the same with every all-reduce replaced by a copy (functional ones) or
                  by nothing (in-place ones; wrong gradients: a measurement of everything
                  but the communication)
  torch           the same model by hand, torch DDP + AdamW
  torch_nosync    the same under DDP.no_sync() (no gradient all-reduce)
(meshlm - meshlm_nocomm) against (torch - torch_nosync) compares communication; the
no-communication pair compares everything else.  Writes DIR/comm_split.{json,md}
(default DIR: benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("meshlm", "meshlm_nocomm", "torch", "torch_nosync")


def _job(steps: int, reps: int) -> dict:
    from bench_layouts import _build_meshlm, _build_torch, _global_batch, interleaved
    from meshlm.models import llama_config

    cfg = llama_config("llama_small")
    X, Y = _global_batch(cfg, 8, 128)
    m = _build_meshlm(cfg, "ddp", {"dp": 4}, X, Y, None)
    t = _build_torch(cfg, "ddp", {"dp": 4}, X, Y, None)
    from meshlm import _torch_compat as compat
    from meshlm.runtime import bucket

    all_reduce, inplace = compat.all_reduce, bucket.flat.all_reduce_inplace

    def meshlm_nocomm():
        compat.all_reduce = lambda x, *a, **k: x.clone()
        bucket.flat.all_reduce_inplace = lambda flat, group, wait: flat
        try:
            return m["step"]()
        finally:
            compat.all_reduce, bucket.flat.all_reduce_inplace = all_reduce, inplace

    def torch_nosync():
        with t["model"].no_sync():
            return t["step"]()

    run = {"meshlm": m["step"], "meshlm_nocomm": meshlm_nocomm, "torch": t["step"], "torch_nosync": torch_nosync}
    for f in run.values():  # warm-up
        f()
        f()
    times = interleaved({k: run[k] for k in VARIANTS}, reps, steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from bench_layouts import write_report
    from harness import DistPool

    t0 = time.perf_counter()
    with DistPool(4, timeout_s=900) as pool:
        med = pool.run(_job, args.steps, args.reps)[0]
    rows = ["| variant | step s |", "|---|---|"] + [f"| {k} | {med[k]:.3f} |" for k in VARIANTS]
    comm = (med["meshlm"] - med["meshlm_nocomm"], med["torch"] - med["torch_nosync"])
    md = (
        f"Command: `python benchmarks/comm_split.py --steps {args.steps} --reps {args.reps}` (ddp, dp=4, "
        "llama_small, batch 8 x seq 128, eager; slowest rank, median)\n\n"
        + "\n".join(rows)
        + f"\n\ncommunication: meshlm {comm[0]:.3f} s, torch {comm[1]:.3f} s; everything else: meshlm "
        f"{med['meshlm_nocomm']:.3f} s, torch {med['torch_nosync']:.3f} s\n"
    )
    write_report(
        Path(args.out),
        "comm_split",
        {"median_step_s": med, "steps": args.steps, "reps": args.reps},
        md,
        time.perf_counter() - t0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
