"""The pieces of context-parallel attention on one process (NOTE [cp attention] in
meshlm/runtime/cp/ring.py): the block schedule against the global causal mask, each block
kernel (torch's CPU flash attention and the matmul fallback) against plain SDPA, and the
logsumexp merge of key blocks against SDPA over all the keys.  The multi-rank schedule runs
in tests/dist/test_cp_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.tolerances import activation_tol, grad_tol
from meshlm.runtime.cp.kernels import block_backward, block_forward, merge
from meshlm.runtime.cp.schedule import blocks, local_positions


def _spec_positions(rank: int, n: int, seq: int, balanced: bool) -> list[int]:
    """The layout as NOTE [cp attention] states it, written out independently."""
    s = seq // n
    if not balanced:
        return list(range(rank * s, (rank + 1) * s))
    c = s // 2
    return [*range(rank * c, (rank + 1) * c), *range((2 * n - 1 - rank) * c, (2 * n - rank) * c)]


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_local_positions_follow_the_layout(n, balanced):
    seq = 4 * n * 3
    got = [local_positions(r, n, seq, balanced).tolist() for r in range(n)]
    assert got == [_spec_positions(r, n, seq, balanced) for r in range(n)]
    assert sorted(p for ps in got for p in ps) == list(range(seq))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_blocks_cover_exactly_the_global_mask(n, balanced, causal):
    """For every (rank, source) the union of the blocks (with their triangular masks) is the
    global mask restricted to the rank's query positions and the source's key positions, and
    no two blocks overlap: nothing attended twice, nothing missed, nothing masked computed."""
    seq = 4 * n
    s = seq // n
    for r in range(n):
        qpos = torch.tensor(_spec_positions(r, n, seq, balanced))
        for src in range(n):
            kpos = torch.tensor(_spec_positions(src, n, seq, balanced))
            want = (kpos[None, :] <= qpos[:, None]) if causal else torch.ones(s, s, dtype=torch.bool)
            got = torch.zeros(s, s, dtype=torch.int64)
            for blk in blocks(r, src, n, s, causal=causal, balanced=balanced):
                rows, cols = torch.arange(s)[blk.q], torch.arange(s)[blk.kv]
                m = torch.ones(len(rows), len(cols), dtype=torch.int64)
                if blk.causal:
                    assert len(rows) == len(cols)
                    m = m.tril()
                got[rows[:, None], cols[None, :]] += m
            assert torch.equal(got, want.long()), (r, src)


def _qkv(hq=4, hkv=2, s=24, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, s, d, generator=g)
    k = torch.randn(2, hkv, s, d, generator=g)
    v = torch.randn(2, hkv, s, d, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _close(got, ref, tol):
    assert got.shape == ref.shape
    err = (got.detach().float() - ref.detach().float()).abs()
    assert bool((err <= tol).all()), f"worst |err| / tol = {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("math", [False, True])
@pytest.mark.parametrize("hkv", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_block_kernel_matches_sdpa(causal, hkv, math):
    """One block is SDPA (out, and its lse from the scores); its backward, given SDPA's own out
    and lse, is SDPA's gradient."""
    q, k, v = _qkv(hkv=hkv)
    scale = 0.3
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    kr = k.detach().repeat_interleave(4 // hkv, 1)
    scores = q.detach() @ kr.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = scores.logsumexp(-1)
    with torch.no_grad():
        out, lse = block_forward(q, k, v, causal, scale, math=math)
        _close(out, ref, activation_tol(ref))
        _close(lse, ref_lse, activation_tol(ref_lse))
        grads = block_backward(dout, q, k, v, ref.detach(), ref_lse, causal, scale, math=math)
    for got, t in zip(grads, (q, k, v)):
        _close(got, t.grad, grad_tol(t.grad))


@pytest.mark.parametrize("math", [False, True])
def test_merged_key_blocks_match_sdpa_over_all_keys(math):
    """Keys cut into three blocks, merged by logsumexp, give attention over all of them; each
    block's backward with the merged out and lse adds up to SDPA's gradient."""
    q, k, v = _qkv(s=24)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    cuts = [slice(0, 5), slice(5, 16), slice(16, 24)]
    with torch.no_grad():
        out = torch.zeros(q.shape)
        lse = torch.full(q.shape[:3], float("-inf"))
        for c in cuts:
            merge(out, lse, slice(None), *block_forward(q, k[:, :, c], v[:, :, c], False, 8**-0.5, math=math))
        _close(out, ref, activation_tol(ref))
        dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
        for c in cuts:
            gq, gk, gv = block_backward(dout, q, k[:, :, c], v[:, :, c], out, lse, False, 8**-0.5, math=math)
            dq += gq
            dk[:, :, c] += gk
            dv[:, :, c] += gv
    for got, t in zip((dq, dk, dv), (q, k, v)):
        _close(got, t.grad, grad_tol(t.grad))
