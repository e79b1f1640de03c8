"""Where a cp step's time goes: cProfile of one step (after a warm-up) of meshlm's ``fsdp_cp``
ring and of the hand-written torch ring (benchmarks/cp_torch_ring.py) on cp=4, rank 0's
functions by their own time.

    python benchmarks/cp_profile.py [--model llama_small] [--seq 2048] [--ops]

Prints both tables (the figures in docs/benchmarks.md, "Context parallel", come from it).
With ``--ops``, torch.profiler instead of cProfile, on ranks 0 and 3: every aten and c10d op
by its own time, then by input shapes (``record_shapes``), which tells the attention kernels,
the matmuls, the gradient reductions' waits and DTensor's dispatch (``PythonSubclass``) apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]


def _job(opts):
    import torch.distributed as dist

    import cp_bench as cb
    import run_meta
    from meshlm.models import llama_config

    cfg = llama_config(opts["model"])
    variants = {
        "meshlm ring cp=4": cb._build_meshlm(cfg, cb._cp_layout("ring", True), "cp=4", 4, opts),
        "torch ring cp=4": cb._build_torch(cfg, 4, opts),
    }
    out = {}
    for key, v in variants.items():
        v["step"]()
        dist.barrier()
        if opts["ops"]:
            out[key] = _ops_profile(v["step"])
            dist.barrier()
            continue
        out[key] = run_meta.profile_step(v["step"])
        dist.barrier()
    return out


def _ops_profile(step):
    """(step seconds, torch.profiler tables of one step: by op, then by op and input shapes)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        step()
        t = time.perf_counter() - t

    def table(events, shapes: bool) -> str:
        rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:30]
        return "\n".join(
            f"{e.count:5d} {e.self_cpu_time_total / 1e3:9.1f} ms self {e.cpu_time_total / 1e3:9.1f} ms total  "
            f"{e.key[:60]:60s} {str(e.input_shapes)[:100] if shapes else ''}"
            for e in rows
        )

    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    text = f"profiled self time {total:.3f} s\n{table(prof.key_averages(), False)}\n--- by input shapes\n"
    return t, text + table(prof.key_averages(group_by_input_shape=True), True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="cProfile of one cp=4 step, meshlm ring and torch ring")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ops", action="store_true", help="torch.profiler by op and input shapes, ranks 0 and 3")
    args = ap.parse_args(argv)
    from harness import DistPool

    opts = dict(model=args.model, seq=args.seq, rows=1, reps=1, balance=True, ops=args.ops)
    with DistPool(4, timeout_s=300, job_timeout_s=900) as pool:
        res = pool.run(_job, opts)
    for rank in (0, 3) if args.ops else (0,):
        for key, (t, text) in res[rank].items():
            print(f"===== rank {rank}, {key}: {t:.3f} s")
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
