"""What one collective costs on this machine's CPU backend: gloo, 4 ranks.

    python benchmarks/gloo_collectives.py [--mb 11.8] [--reps 8] [--pairs] [--out DIR]

The collectives meshlm's CPU steps are made of, timed on one 4-rank gloo pool (each the
slowest rank's time from a barrier, median over ``--reps`` interleaved rounds):
  all_reduce            one in-place all-reduce of the whole buffer (``--mb``, default
                        llama_small's 11.8 MB of fp32 parameters: what DDP reduces per step)
  all_reduce_x4         the same bytes as four in-place all-reduces (one per block)
  all_reduce_x4_copy    the same four out of place (funcol.all_reduce: a fresh output each)
  reduce_scatter        one reduce-scatter of the whole buffer (ZeRO-1/2's gradients)
  all_gather            one all-gather into the whole buffer (ZeRO's updated shards)
  small_x3              three all-reduces of 0.26 MB (llama_small's embedding, head, norm)
  reduce_scatter_x4     the whole buffer as four reduce-scatters (one per block: the
                        optimizer's chunks), each waited for before the next is issued
  reduce_scatter_x4_2   the same four, the next issued before the one before it is waited
                        for (two in flight: meshlm's flat moves, NOTE [reductions in flight])
  reduce_scatter_x4_4   the same four issued at once, then waited for
With ``--pairs`` every collective runs over pairs of ranks ({0, 1} and {2, 3} at once:
the data axis inside one stage of pp=2 x fsdp=2), and the report is
gloo_collectives_pairs.  Writes DIR/gloo_collectives.{json,md} (default DIR:
benchmarks/results).
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
KINDS = (
    "all_reduce",
    "all_reduce_x4",
    "all_reduce_x4_copy",
    "reduce_scatter",
    "all_gather",
    "small_x3",
    "reduce_scatter_x4",
    "reduce_scatter_x4_2",
    "reduce_scatter_x4_4",
)


def _job(mb: float, reps: int, pairs: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from bench_layouts import interleaved

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    world = dist.get_world_size()
    if pairs:
        mine = None
        for ranks in ([0, 1], [2, 3]):
            g = dist.new_group(ranks)  # every rank makes every group, in the same order
            if dist.get_rank() in ranks:
                mine = g
        group, world = mine.group_name, 2
    n = int(mb * 1e6 / 4) // (4 * world) * (4 * world)
    whole = torch.randn(n)
    quarters = [torch.randn(n // 4) for _ in range(4)]
    shard = torch.randn(n // world)
    small = [torch.randn(65536) for _ in range(3)]

    def wait(t):
        return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t

    def scatter_quarters(depth: int) -> None:
        flight = []
        for q in quarters:
            flight.append(funcol.reduce_scatter_tensor(q, "sum", 0, group))
            while len(flight) >= depth:
                wait(flight.pop(0))
        for t in flight:
            wait(t)

    run = {
        "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce_(whole, "sum", group)),
        "all_reduce_x4": lambda: [c10d.wait_tensor(c10d.all_reduce_(q, "sum", group)) for q in quarters],
        "all_reduce_x4_copy": lambda: [wait(funcol.all_reduce(q, "sum", group)) for q in quarters],
        "reduce_scatter": lambda: wait(funcol.reduce_scatter_tensor(whole, "sum", 0, group)),
        "all_gather": lambda: wait(funcol.all_gather_tensor(shard, 0, group)),
        "small_x3": lambda: [c10d.wait_tensor(c10d.all_reduce_(s, "sum", group)) for s in small],
        "reduce_scatter_x4": lambda: scatter_quarters(1),
        "reduce_scatter_x4_2": lambda: scatter_quarters(2),
        "reduce_scatter_x4_4": lambda: scatter_quarters(4),
    }
    for f in run.values():  # warm-up
        f()
    times = interleaved({k: run[k] for k in KINDS}, reps)
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "mb": n * 4 / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=11.8)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--pairs", action="store_true", help="over pairs of ranks, two pairs at once")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from bench_layouts import write_report
    from harness import DistPool

    t0 = time.perf_counter()
    with DistPool(4, timeout_s=300) as pool:
        res = pool.run(_job, args.mb, args.reps, args.pairs)[0]  # (every rank holds the slowest times)
    rows = ["| collective | ms |", "|---|---|"] + [f"| {k} | {res['ms'][k]:.1f} |" for k in KINDS]
    md = (
        f"Command: `python benchmarks/gloo_collectives.py --mb {args.mb} --reps {args.reps}"
        f"{' --pairs' if args.pairs else ''}` (4 gloo ranks{', in two pairs at once' if args.pairs else ''}, "
        f"{res['mb']:.1f} MB fp32 buffer; slowest rank, median)\n\n" + "\n".join(rows) + "\n"
    )
    name = "gloo_collectives_pairs" if args.pairs else "gloo_collectives"
    write_report(Path(args.out), name, {**res, "reps": args.reps}, md, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
