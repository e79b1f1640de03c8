"""meshlm.nn.MoE's experts as one batched matmul against a Python loop over experts, on one
process (forward + backward of one MoE layer, float32, CPU).

The loop is the straightforward implementation: for each expert, gather its tokens
(``index_select``), run its SwiGLU, scatter the gated outputs back (``index_add_``); it does
no padded work.  meshlm's layer places the tokens in a (batch, experts, capacity, embed)
buffer and runs every expert at once, padded slots included (NOTE [moe routing] in
meshlm/core/moe.py).  Both compute the same outputs (checked here before timing).

    python benchmarks/moe_grouped.py --embed 256 --mlp 352 --experts 8 --top-k 2 --batch 8 --seq 128
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from meshlm.core.annotate import init_params
from meshlm.core.moe import MoE


def loop_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Dropless top-k routing with a loop over experts (the same router and gates as ``m``)."""
    b, s, d = x.shape
    flat = x.reshape(-1, d)
    probs = F.linear(flat.float(), m.router.float()).softmax(-1)
    gates, idx = probs.topk(m.top_k, dim=-1)
    if m.norm_topk:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in range(m.experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = flat.index_select(0, tok)
        y = F.linear(F.silu(F.linear(h, m.w_gate[e])) * F.linear(h, m.w_up[e]), m.w_down[e])
        out = out.index_add(0, tok, y * gates[tok, slot, None].to(y.dtype))
    return out.view(b, s, d)


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=352)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--capacity-factor", type=float, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = MoE(a.embed, a.mlp, a.experts, a.top_k, capacity_factor=a.capacity_factor)
    init_params(m, 0)
    x = torch.randn(a.batch, a.seq, a.embed, requires_grad=True)
    if a.capacity_factor is None:
        torch.testing.assert_close(m(x)[0], loop_moe(m, x), rtol=1e-4, atol=1e-5)

    def step(f):
        return lambda: f().sum().backward()

    batched = timed(step(lambda: m(x)[0]), a.reps)
    looped = timed(step(lambda: loop_moe(m, x)), a.reps)
    route = "dropless" if a.capacity_factor is None else f"capacity factor {a.capacity_factor}"
    print(
        f"MoE embed {a.embed}, {a.experts} experts of {a.mlp}, top {a.top_k}, {a.batch}x{a.seq} tokens, {route}, "
        f"{a.threads} thread(s): batched {batched * 1e3:.1f} ms, loop over experts {looped * 1e3:.1f} ms "
        f"(forward + backward; batched / loop = {batched / looped:.2f})"
    )


if __name__ == "__main__":
    main()
