"""What one collective costs on this machine's CPU backend: gloo, 4 ranks.

    python benchmarks/gloo_collectives.py [--mb 11.8] [--reps 8] [--out DIR]

The collectives meshlm's CPU steps are made of, timed on one 4-rank gloo pool (each the
slowest rank's time from a barrier, median over ``--reps`` interleaved rounds):
  all_reduce            one in-place all-reduce of the whole buffer (``--mb``, default
                        llama_small's 11.8 MB of fp32 parameters: what DDP reduces per step)
  all_reduce_x4         the same bytes as four in-place all-reduces (one per block)
  all_reduce_x4_copy    the same four out of place (funcol.all_reduce: a fresh output each)
  reduce_scatter        one reduce-scatter of the whole buffer (ZeRO-1/2's gradients)
  all_gather            one all-gather into the whole buffer (ZeRO's updated shards)
  small_x3              three all-reduces of 0.26 MB (llama_small's embedding, head, norm)
Writes DIR/gloo_collectives.{json,md} (default DIR: benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("all_reduce", "all_reduce_x4", "all_reduce_x4_copy", "reduce_scatter", "all_gather", "small_x3")


def _job(mb: float, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from bench_layouts import interleaved

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    world = dist.get_world_size()
    n = int(mb * 1e6 / 4) // (4 * world) * (4 * world)
    whole = torch.randn(n)
    quarters = [torch.randn(n // 4) for _ in range(4)]
    shard = torch.randn(n // world)
    small = [torch.randn(65536) for _ in range(3)]

    def wait(t):
        return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t

    run = {
        "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce_(whole, "sum", group)),
        "all_reduce_x4": lambda: [c10d.wait_tensor(c10d.all_reduce_(q, "sum", group)) for q in quarters],
        "all_reduce_x4_copy": lambda: [wait(funcol.all_reduce(q, "sum", group)) for q in quarters],
        "reduce_scatter": lambda: wait(funcol.reduce_scatter_tensor(whole, "sum", 0, group)),
        "all_gather": lambda: wait(funcol.all_gather_tensor(shard, 0, group)),
        "small_x3": lambda: [c10d.wait_tensor(c10d.all_reduce_(s, "sum", group)) for s in small],
    }
    for f in run.values():  # warm-up
        f()
    times = interleaved({k: run[k] for k in KINDS}, reps)
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "mb": n * 4 / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=11.8)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from bench_layouts import write_report
    from meshlm.testing import DistPool

    t0 = time.perf_counter()
    with DistPool(4, timeout_s=300) as pool:
        res = pool.run(_job, args.mb, args.reps)[0]
    rows = ["| collective | ms |", "|---|---|"] + [f"| {k} | {res['ms'][k]:.1f} |" for k in KINDS]
    md = (
        f"Command: `python benchmarks/gloo_collectives.py --mb {args.mb} --reps {args.reps}` (4 gloo ranks, "
        f"{res['mb']:.1f} MB fp32 buffer; slowest rank, median)\n\n" + "\n".join(rows) + "\n"
    )
    write_report(Path(args.out), "gloo_collectives", {**res, "reps": args.reps}, md, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
