"""Where a cp step's time goes: cProfile of one step (after a warm-up) of meshlm's ``fsdp_cp``
ring and of the hand-written torch ring (benchmarks/cp_torch_ring.py) on cp=4, rank 0's
functions by their own time.

    python benchmarks/cp_profile.py [--model llama_small] [--seq 2048]

Prints both tables (the figures in docs/benchmarks.md, "Context parallel", come from it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]


def _job(opts):
    import cProfile
    import io
    import pstats
    import time

    import torch.distributed as dist

    import cp_bench as cb
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
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        v["step"]()
        prof.disable()
        t = time.perf_counter() - t
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out[key] = (t, text.getvalue())
        dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="cProfile of one cp=4 step, meshlm ring and torch ring")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)
    from harness import DistPool

    opts = dict(model=args.model, seq=args.seq, rows=1, reps=1, balance=True)
    with DistPool(4, timeout_s=300, job_timeout_s=900) as pool:
        res = pool.run(_job, opts)[0]
    for key, (t, text) in res.items():
        print(f"===== rank 0, {key}: {t:.3f} s")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
