"""A hand-written context-parallel peer in plain torch (benchmarks/cp_bench.py): a Llama-like
block stack whose sequence is split over a cp group and whose attention is a ring of
``torch.distributed`` isend/irecv of keys and values, merged by the online softmax; the
parameters are replicated on every rank and their gradients all-reduced.

Rank ``r`` of the cp group holds, with ``balance``, chunks ``r`` and ``2n-1-r`` of ``2n``
equal chunks of each sequence (causal load balancing), else the contiguous ``r``-th of ``n``.
Every block (one local query chunk against one source key chunk: whole, causal on the
diagonal, skipped above it) runs torch's CPU flash attention op, which returns the block's
logsumexp.  Backward passes the keys and values around the ring again with a float32
accumulator of their gradients (n passes), as NOTE [cp attention] in
meshlm/runtime/cp/ring.py counts bytes.  Written from torch alone: nothing of meshlm runs in it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
SENT = [0]  # bytes this rank's isends posted (read by the benchmark)


def chunk_ids(r: int, n: int, balance: bool) -> list[int]:
    """The global chunk indices rank ``r`` holds (of ``2n`` chunks with ``balance``, else ``n``)."""
    return [r, 2 * n - 1 - r] if balance else [r]


def local_positions(seq: int, r: int, n: int, balance: bool) -> torch.Tensor:
    ids = chunk_ids(r, n, balance)
    c = seq // (2 * n if balance else n)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids])


def _pairs(qids, kids):
    """(q chunk slot, k chunk slot, causal) of every block a rank computes."""
    return [(a, b, qa == kb) for a, qa in enumerate(qids) for b, kb in enumerate(kids) if kb <= qa]


class _Exchange:
    def __init__(self, tensors, group, tag):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        nxt, prev = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        self.recv = [torch.empty_like(t) for t in tensors]
        SENT[0] += sum(t.numel() * t.element_size() for t in tensors)
        self.works = [dist.isend(t.contiguous(), nxt, group=group, tag=tag + i) for i, t in enumerate(tensors)]
        self.works += [dist.irecv(t, prev, group=group, tag=tag + i) for i, t in enumerate(self.recv)]

    def wait(self):
        for w in self.works:
            w.wait()
        return self.recv


class RingAttention(torch.autograd.Function):
    """Causal attention of local ``q, k, v`` (b, h, s, d) over the cp group's whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, group, balance):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        nc = len(chunk_ids(r, n, balance))
        c = q.shape[2] // nc
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32)
        kk, vv = k, v
        for i in range(n):
            ex = _Exchange((kk, vv), group, 0) if i < n - 1 else None
            src = (r - i) % n
            for a, b, causal in _pairs(chunk_ids(r, n, balance), chunk_ids(src, n, balance)):
                rows = slice(a * c, (a + 1) * c)
                o, l_ = _fwd(
                    q[:, :, rows],
                    kk[:, :, b * c : (b + 1) * c],
                    vv[:, :, b * c : (b + 1) * c],
                    0.0,
                    causal,
                    scale=scale,
                )
                old = lse[:, :, rows]
                new = torch.logaddexp(old, l_.float())
                out[:, :, rows] = (
                    out[:, :, rows] * torch.exp(old - new)[..., None] + o.float() * torch.exp(l_ - new)[..., None]
                )
                lse[:, :, rows] = new
            if ex is not None:
                kk, vv = ex.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balance = group, balance
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, balance = ctx.group, ctx.balance
        n, r = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // len(chunk_ids(r, n, balance))
        scale = 1.0 / math.sqrt(q.shape[-1])
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32)
        kk, vv = k, v
        acc = None  # the (dk, dv) accumulator in flight: of the keys this rank holds next
        for i in range(n):
            src = (r - i) % n
            ex = _Exchange((kk, vv), group, 0) if i < n - 1 else None
            dk, dv = torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)
            for a, b, causal in _pairs(chunk_ids(r, n, balance), chunk_ids(src, n, balance)):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                gq, gk, gv = _bwd(
                    dout[:, :, rows], q[:, :, rows], kk[:, :, cols], vv[:, :, cols],
                    out[:, :, rows], lse[:, :, rows], 0.0, causal, scale=scale,
                )  # fmt: skip
                dq[:, :, rows] += gq.float()
                dk[:, :, cols] += gk.float()
                dv[:, :, cols] += gv.float()
            if acc is not None:  # the earlier ranks' shares of source src, received during this step's blocks
                rk, rv = acc.wait()
                dk += rk
                dv += rv
            acc = _Exchange((dk, dv), group, 2)  # on to the next rank, overlapping the next step's blocks
            if ex is not None:
                kk, vv = ex.wait()
        # after n passes the accumulator of this rank's own keys has come home
        dk, dv = acc.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class _Block(nn.Module):
    def __init__(self, embed, heads, kv_heads, mlp):
        super().__init__()
        self.h, self.hkv, self.hd = heads, kv_heads, embed // heads
        self.n1, self.n2 = _RMSNorm(embed), _RMSNorm(embed)
        self.wq = nn.Linear(embed, heads * self.hd, bias=False)
        self.wk = nn.Linear(embed, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(embed, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, embed, bias=False)
        self.w1 = nn.Linear(embed, mlp, bias=False)
        self.w3 = nn.Linear(embed, mlp, bias=False)
        self.w2 = nn.Linear(mlp, embed, bias=False)

    def forward(self, x, pos, group, balance):
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, s, self.hkv, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, s, self.hkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos), _rope(k, pos)
        rep = self.h // self.hkv  # repeated before the exchange, as meshlm's Llama does
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if group is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, balance)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RingLM(nn.Module):
    """Embedding, ``layers`` blocks, norm, head; ``forward`` returns this rank's summed token
    loss over ``count`` (the global number of targets), so the sum over ranks is the mean."""

    def __init__(self, vocab, embed, layers, heads, kv_heads, mlp, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, embed)
        self.blocks = nn.ModuleList(_Block(embed, heads, kv_heads, mlp) for _ in range(layers))
        self.norm = _RMSNorm(embed)
        self.head = nn.Linear(embed, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels, pos, count, group=None, balance=True):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, pos, group, balance)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count


def allreduce_grads(model: nn.Module) -> None:
    """Sum every gradient over the world (one flat buffer): replicated parameters."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    i = 0
    for g in grads:
        g.copy_(flat[i : i + g.numel()].view_as(g))
        i += g.numel()
