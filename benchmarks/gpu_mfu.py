"""Single-GPU throughput, MFU, and meshlm's overhead on a one-device mesh.

    python benchmarks/gpu_mfu.py                      # llama_1b, bf16, compiled, seq 2048, CUDA
    python benchmarks/gpu_mfu.py --device cpu --model llama_tiny --seq 64 --backend aot_eager  # logic check

Two variants of the same model, same weights (seed 0), same per-block torch.compile (none
with --backend none), same AdamW, parameters and optimizer state in bf16 (pure bf16
training, no master copy):
  plain   meshlm.models.Llama on the device, not sharded (annotations are inert)
  meshlm  meshlm.shard(Llama(cfg, device="meta"), "single", one-device mesh) + ShardedOptimizer
After warm-up (compile), the two run `--steps` steps each, interleaved for `--reps` rounds;
step time is the median (synchronised).  Overhead = meshlm / plain - 1 (target <= 3%).

MFU = tokens/s x FLOPs per token / peak, with FLOPs per token as torchtitan counts them:
6 (Psi - Psi_embedding) + 12 L h s, where Psi_embedding is the token
embedding only (the untied output head is counted as a matmul), L layers, h = embed, s = seq.
Peak: --peak-tflops, default 989 (dense bf16 H100/H200) on CUDA; none on CPU (no MFU).
Writes benchmarks/results/gpu_mfu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def flops_per_token(cfg, seq: int) -> int:
    """6 (Psi - Psi_embedding) + 12 L h s (torchtitan's count)."""
    psi = cfg.num_params(embedding=True)
    psi_emb = cfg.vocab * cfg.embed  # the token embedding (a lookup, no FLOPs)
    return 6 * (psi - psi_emb) + 12 * cfg.layers * cfg.embed * seq


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="llama_1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="inductor", help='torch.compile backend per block; "none": eager, no compile')
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peak-tflops", type=float, default=None, help="default 989 on CUDA, none on CPU")
    ap.add_argument("--out", default=str(RESULTS / "gpu_mfu.json"))
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_mfu.py: CUDA is not available on this machine. This benchmark measures a GPU; run it on "
            "one, or check its logic here with: python benchmarks/gpu_mfu.py --device cpu --model llama_tiny "
            "--seq 64 --backend aot_eager",
            file=sys.stderr,
        )
        return 2

    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = llama_config(args.model)
    peak = args.peak_tflops if args.peak_tflops is not None else (989.0 if dev.type == "cuda" else None)
    torch.manual_seed(0)
    toks = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = toks[:, :-1].contiguous().to(dev), toks[:, 1:].contiguous().to(dev)  # meshlm: labels must be contiguous
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    # plain: the model itself, no meshlm lowering
    t0 = time.perf_counter()
    plain = Llama(cfg, seed=0).to(device=dev, dtype=dtype)  # initialised on the CPU, then moved
    if args.backend != "none":
        compile_blocks(plain, backend=args.backend)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    # meshlm on a one-device mesh
    mesh = meshlm.make_mesh({"dp": 1}, device_type=dev.type)
    mm = meshlm.shard(Llama(cfg, device="meta").to(dtype), "single", mesh, seed=0)
    if args.backend != "none":
        compile_blocks(mm, backend=args.backend)
    opt_mm = ShardedOptimizer(mm, torch.optim.AdamW, lr=1e-4)
    build_s = time.perf_counter() - t0

    def make_step(model, opt):
        def step():
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    variants = {"plain": make_step(plain, opt_plain), "meshlm": make_step(mm, opt_mm)}
    losses, warm = {}, {}
    for name, step in variants.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            losses[name] = float(step().detach())
        _sync(dev)
        warm[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args.reps):
        for name, step in variants.items():
            for _ in range(args.steps):
                _sync(dev)
                t0 = time.perf_counter()
                step()
                _sync(dev)
                times[name].append(time.perf_counter() - t0)

    fpt = flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    out = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "params": cfg.num_params(),
        "dtype": args.dtype,
        "seq": args.seq,
        "batch": args.batch,
        "backend": args.backend,
        "flops_per_token": fpt,
        "flops_formula": "6*(Psi - Psi_embedding) + 12*L*h*s (torchtitan; Psi_embedding = token embedding)",
        "peak_tflops": peak,
        "build_s": build_s,
        "warmup_s": warm,
        "loss_after_warmup": losses,
    }
    for name, ts in times.items():
        med = statistics.median(ts)
        tps = tokens / med
        out[name] = {
            "step_s": med,
            "tokens_per_s": tps,
            "mfu": (tps * fpt / (peak * 1e12)) if peak else None,
            "times": ts,
        }
    out["meshlm_overhead"] = out["meshlm"]["step_s"] / out["plain"]["step_s"] - 1
    if dev.type == "cuda":
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30

    print(
        f"{args.model} ({cfg.num_params() / 1e9:.3f} B params), {args.dtype}, {args.backend}, batch {args.batch} "
        f"x seq {args.seq}, on {out['device']}"
    )
    print(
        f"FLOPs/token = 6*(Psi - Psi_embedding) + 12*L*h*s = {fpt / 1e9:.3f} GFLOP; peak "
        f"{peak if peak else 'n/a'} TFLOP/s"
    )
    for name in variants:
        r = out[name]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (no peak given)"
        print(f"  {name:7s} {r['step_s'] * 1e3:8.1f} ms/step  {r['tokens_per_s']:10.0f} tokens/s  MFU {mfu}")
    print(f"  loss after warm-up (same weights, same data): plain {losses['plain']:.4f}, meshlm {losses['meshlm']:.4f}")
    print(f"  meshlm overhead on a one-device mesh: {100 * out['meshlm_overhead']:+.1f}% (target <= 3%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
