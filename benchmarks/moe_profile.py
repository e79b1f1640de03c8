"""Where an expert-parallel step's time goes: cProfile of one step (after a warm-up) of
meshlm's MoE layers under ``fsdp_ep`` on ep=4 and of the hand-written torch all-to-all MoE
(benchmarks/moe_torch_a2a.py) on ep=4, rank 0's functions by their own time.

    python benchmarks/moe_profile.py [--model moe_small] [--batch 8] [--seq 128]

Prints both tables (docs/benchmarks.md, "Mixture of experts: meshlm against a torch all-to-all").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]


def _job(opts):
    import torch.distributed as dist

    import moe_bench as mb
    import run_meta

    dims = mb._dims(opts)
    ours = mb._build_meshlm("meshlm fsdp_ep", "fsdp_ep", "ep=4", dims, opts)
    variants = {"meshlm fsdp_ep ep=4": ours, "torch a2a ep=4": mb._build_torch(4, dims, opts, ours["full"])}
    out = {}
    for key, v in variants.items():
        v["step"]()
        dist.barrier()
        out[key] = run_meta.profile_step(v["step"])
        dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="cProfile of one ep=4 step, meshlm fsdp_ep and a torch all-to-all MoE")
    ap.add_argument("--model", default="moe_small")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    from harness import DistPool

    with DistPool(4, timeout_s=300, job_timeout_s=900) as pool:
        res = pool.run(_job, vars(args))[0]
    for key, (t, text) in res.items():
        print(f"===== rank 0, {key}: {t:.3f} s")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
