"""Context-parallel attention on local tensors: each rank of the cp group holds its chunks of
the sequence (queries, keys and values) and gets the exact attention of its queries over
the whole sequence, forward and backward.

NOTE [cp attention]
    Layout.  ``n`` ranks of the cp group, rank ``r`` (its rank in the group) holding ``s``
    tokens of a global sequence of ``S = n*s``: the contiguous ``[r*s, (r+1)*s)``, or with
    ``balanced`` (causal load balancing) the chunks ``r`` and ``2n-1-r`` of ``c = s/2``
    tokens (meshlm/runtime/cp/schedule.py, ``local_positions``).  Causal is in global
    positions.  Queries have ``hq`` heads, keys and values ``hkv`` (``hq % hkv == 0``); keys
    and values cross the wire with their ``hkv`` heads, never repeated.

    Blocks.  Against the keys of one source rank, a rank computes at most one block of its
    queries (``schedule.blocks``): its own keys with the lower-triangular mask, an earlier
    rank's whole (unbalanced) or its head chunk (balanced, every query), a later rank's
    tail-query rows against both its chunks (balanced) or nothing (unbalanced: rank 0 does
    one block, rank n-1 does n; balanced: every rank does the same work).  Each block runs
    torch's CPU flash attention (meshlm/runtime/cp/kernels.py), giving its output and the
    float32 logsumexp of its scores; blocks merge by the online softmax in float32
    (``out = sum_j exp(lse_j - lse) out_j``, ``lse = logaddexp_j lse_j``).  Backward feeds
    each block the *global* out and lse of its rows, which makes the block's dq, dk, dv its
    exact share; shares add up in float32.

    ``variant="ring"``.  Forward: n steps; at step i a rank attends the keys and values of
    rank ``r - i`` while it sends the pair it holds to ``r + 1`` and receives the next from
    ``r - 1`` (isend/irecv posted before the step's blocks, waited after).  Backward: the
    same ring of keys and values, and a float32 accumulator of (dk, dv) that travels with
    them: each rank adds its share for the pair it holds and passes the accumulator on, so
    after the n-th pass (one more than the key/value passes) it arrives at its owner with
    every rank's share.  Each pass overlaps the next step's blocks.
    ``variant="allgather"``.  Forward all-gathers K and V once and runs the same blocks
    against every rank's chunk; backward all-gathers them again (nothing n times the local
    size is kept between the passes), computes every rank's (dk, dv) share in float32 and
    reduce-scatters them to their owners.

    Bytes per rank per attention call, with ``K`` the local bytes of k (= of v, hkv heads) and
    ``F = 4 * numel(k)`` the float32 accumulator's (NOTE [logical bytes] in
    meshlm/runtime/comm.py; n > 1):
        ring forward     send 2(n-1)K                   (each of n-1 steps sends k and v)
        ring backward    send 2(n-1)K + 2nF             (k, v again; the dk, dv accumulator n times)
        (the receives are the same sizes, counted with 0 wire bytes)
        allgather fwd    all_gather 2nK logical          (k and v, each n*K gathered)
        allgather bwd    all_gather 2nK logical, reduce_scatter 2nF logical
    so a rank puts (n-1)/n of the global K and V (2nK) on the wire in forward either way:
    the ring as n-1 sends, the all-gather as its ring factor (n-1)/n.  The ring's backward
    sends the accumulators n times (2nF), the all-gather's reduce-scatter (n-1)/n of 2nF.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.errors import ConfigError
from meshlm.runtime.cp.kernels import block_backward, block_forward, merge
from meshlm.runtime.cp.schedule import blocks

VARIANTS = ("ring", "allgather")

# p2p tags: the key/value ring and the gradient accumulator ring can be in flight together.
_TAG_KV = 0
_TAG_DKV = 2


class _Shift:
    """Send ``tensors`` to the next rank of the ring and receive as many from the previous,
    in flight until ``wait()`` (which returns the received tensors)."""

    def __init__(self, tensors: tuple[Tensor, ...], group, tag: int):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        nxt, prev = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        self.works = [dist.isend(t, nxt, group=group, tag=tag + i) for i, t in enumerate(self.sent)]
        self.works += [dist.irecv(t, prev, group=group, tag=tag + i) for i, t in enumerate(self.received)]

    def wait(self) -> tuple[Tensor, ...]:
        for w in self.works:
            w.wait()
        return tuple(self.received)


def _gather(t: Tensor, group) -> Tensor:
    """Every rank's ``t`` stacked along dim 0 in group-rank order."""
    out = compat.all_gather_single(t.contiguous(), 0, group)
    return out.wait() if isinstance(out, compat.AsyncCollectiveTensor) else out


def _reduce_scatter(t: Tensor, group) -> Tensor:
    out = compat.reduce_scatter_single(t.contiguous(), "sum", 0, group)
    return out.wait() if isinstance(out, compat.AsyncCollectiveTensor) else out


def _check(q: Tensor, k: Tensor, v: Tensor, group, balanced: bool, variant: str) -> None:
    if variant not in VARIANTS:
        raise ConfigError(f"context parallel attention: variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"context parallel attention takes q (batch, heads, seq, head_dim) and k, v (batch, kv_heads, "
            f"seq, head_dim) of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, hq, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d) or hq % k.shape[1]:
        raise ValueError(
            f"context parallel attention: k {tuple(k.shape)} does not match q {tuple(q.shape)} (same batch, local "
            f"seq and head_dim, and kv_heads dividing heads)"
        )
    if balanced and s % 2:
        raise ValueError(
            f"context parallel attention with load balancing: the local sequence ({s} tokens) holds two "
            f"chunks and must be even; make the sequence length a multiple of 2 x cp "
            f"({2 * dist.get_world_size(group)})"
        )


def _sources(variant: str, k: Tensor, v: Tensor, group):
    """Yield ``(src, k_src, v_src)`` for every rank of the group, this rank's own first.
    The ring sends each pair on while its blocks are computed."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if variant == "allgather":
        ks, vs = _gather(k, group).chunk(n), _gather(v, group).chunk(n)
        for i in range(n):
            src = (r - i) % n
            yield src, ks[src], vs[src]
        return
    kv = (k, v)
    for i in range(n):
        shift = _Shift(kv, group, _TAG_KV) if i < n - 1 else None
        yield (r - i) % n, kv[0], kv[1]
        if shift is not None:
            kv = shift.wait()


def cp_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group, causal: bool, balanced: bool, scale: float | None, variant: str
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's local queries over the global sequence (NOTE [cp attention]).

    ``q`` (b, hq, s, d); ``k``, ``v`` (b, hkv, s, d), ``hq % hkv == 0``: this rank's local
    chunk(s) of the cp ``group``.  Returns ``out`` (b, hq, s, d) in q's dtype and ``lse``
    (b, hq, s) float32, the logsumexp of each query row's scaled scores over every key it
    attends globally."""
    _check(q, k, v, group, balanced, variant)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n, r, s = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for src, ks, vs in _sources(variant, k, v, group):
        for blk in blocks(r, src, n, s, causal=causal, balanced=balanced):
            block = block_forward(q[:, :, blk.q], ks[:, :, blk.kv], vs[:, :, blk.kv], blk.causal, scale)
            merge(out, lse, blk.q, *block)
    return out.to(q.dtype), lse


def _block_grads(r, src, n, dout, q, ks, vs, out, lse, dq, causal, balanced, scale) -> tuple[Tensor, Tensor]:
    """Add this rank's queries' share against source ``src`` to ``dq``; return its float32
    (dk, dv) share for ``src``'s keys and values."""
    dk = torch.zeros(ks.shape, dtype=torch.float32, device=ks.device)
    dv = torch.zeros(vs.shape, dtype=torch.float32, device=vs.device)
    for blk in blocks(r, src, n, q.shape[2], causal=causal, balanced=balanced):
        gq, gk, gv = block_backward(
            dout[:, :, blk.q], q[:, :, blk.q], ks[:, :, blk.kv], vs[:, :, blk.kv], out[:, :, blk.q], lse[:, :, blk.q],
            blk.causal, scale,
        )  # fmt: skip
        dq[:, :, blk.q] += gq
        dk[:, :, blk.kv] += gk
        dv[:, :, blk.kv] += gv
    return dk, dv


def cp_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    group,
    causal: bool,
    balanced: bool,
    scale: float | None,
    variant: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's local chunks, exact, given the local ``out`` and ``lse``
    that :func:`cp_attention_forward` returned; dk, dv with k's heads and dtype."""
    _check(q, k, v, group, balanced, variant)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n, r = dist.get_world_size(group), dist.get_rank(group)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if variant == "allgather":
        shares = [None] * n
        for src, ks, vs in _sources(variant, k, v, group):
            shares[src] = _block_grads(r, src, n, dout, q, ks, vs, out, lse, dq, causal, balanced, scale)
        dk = _reduce_scatter(torch.cat([g[0] for g in shares]), group)
        dv = _reduce_scatter(torch.cat([g[1] for g in shares]), group)
    else:
        passing = None  # the (dk, dv) accumulator in flight to the next rank
        for src, ks, vs in _sources(variant, k, v, group):
            dk, dv = _block_grads(r, src, n, dout, q, ks, vs, out, lse, dq, causal, balanced, scale)
            if passing is not None:
                acc_k, acc_v = passing.wait()  # the accumulator for src's keys, from r - 1
                dk, dv = dk + acc_k, dv + acc_v
            passing = _Shift((dk, dv), group, _TAG_DKV) if n > 1 else None
        if passing is not None:
            dk, dv = passing.wait()  # our own keys' accumulator, every rank's share in it
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, balanced, scale, variant):
        out, lse = cp_attention_forward(
            q, k, v, group=group, causal=causal, balanced=balanced, scale=scale, variant=variant
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = dict(group=group, causal=causal, balanced=balanced, scale=scale, variant=variant)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = cp_attention_backward(dout, q, k, v, out, lse, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group,
    causal: bool = True,
    balanced: bool = False,
    scale: float | None = None,
    variant: str = "ring",
) -> Tensor:
    """Differentiable context-parallel attention of local chunks over the cp ``group``
    (:func:`cp_attention_forward`, :func:`cp_attention_backward`, NOTE [cp attention])."""
    return _CpAttention.apply(q, k, v, group, causal, balanced, scale, variant)
