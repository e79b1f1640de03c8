"""A hand-written expert-parallel mixture of experts in plain torch (benchmarks/moe_bench.py):
a stack of residual top-k MoE layers whose experts are split over an ``ep`` group of
consecutive ranks, tokens sent to their experts' rank and back by ``all_to_all_single``.

The routing is GShard's, as DeepSpeed-MoE's layer runs it: per sequence (each row of the
batch), every token's first choice in position order, then every second choice, fills each
expert's ``cap`` slots; the tokens go into a dense ``(rows, experts, cap, embed)`` buffer by a
0/1 dispatch einsum, the buffer's expert dim is cut into one slice per ep rank and exchanged
by one all-to-all of equal splits, each rank runs its experts' SwiGLU as one batched matmul,
and a second all-to-all returns the outputs, combined with the (renormalised) gates.  The
router and every other parameter are replicated; gradients are summed over the ranks that
hold a copy (the router over the world, an expert over the ranks at the same place of each ep
group) in one flat all-reduce per group.  Written from torch alone: nothing of meshlm runs in it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SENT = [0.0]  # wire bytes this rank's collectives moved (all-to-all (n-1)/n, all-reduce 2(n-1)/n)


def _wire(kind: str, nbytes: int, n: int) -> float:
    return nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)


class _AllToAll(torch.autograd.Function):
    """Dim 0 (one slice per rank of ``group``) exchanged: slice j goes to rank j; the
    gradient comes back the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a(x, group)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.group), None


def _a2a(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    SENT[0] += _wire("all_to_all", x.numel() * x.element_size(), dist.get_world_size(group))
    dist.all_to_all_single(out, x, group=group)
    return out


def route(logits, top_k: int, cap: int, norm_topk: bool = True):
    """GShard routing per row: ``(dispatch, combine)``, each ``(rows, seq, experts, cap)``."""
    b, s, e = logits.shape
    probs = logits.softmax(-1)
    gates, idx = probs.topk(top_k, dim=-1)  # (b, s, k)
    if norm_topk:
        gates = gates / gates.sum(-1, keepdim=True)
    onehot = F.one_hot(idx, e).to(probs.dtype)  # (b, s, k, e)
    # choice-major priority: all first choices of the row in position order, then the second...
    prio = onehot.permute(0, 2, 1, 3).reshape(b, top_k * s, e)
    pos = (prio.cumsum(1) - 1).mul(prio).sum(-1).reshape(b, top_k, s).permute(0, 2, 1)  # (b, s, k)
    kept = onehot * (pos < cap).to(probs.dtype)[..., None]
    where = F.one_hot(pos.clamp(max=cap - 1).long(), cap).to(probs.dtype)  # (b, s, k, cap)
    dispatch = torch.einsum("bske,bskc->bsec", kept, where)
    combine = torch.einsum("bske,bskc->bsec", kept * gates[..., None], where)
    return dispatch, combine


class MoELayer(nn.Module):
    """``experts`` SwiGLU experts of width ``mlp``, this rank holding ``experts / n`` of them
    (its place ``r`` in an ep group of ``n``) and the whole router."""

    def __init__(self, embed, mlp, experts, top_k, cap_factor, n=1, r=0):
        super().__init__()
        el = experts // n
        self.experts, self.top_k, self.cap_factor, self.n, self.r = experts, top_k, cap_factor, n, r
        self.router = nn.Parameter(torch.zeros(experts, embed))
        self.w_gate = nn.Parameter(torch.zeros(el, mlp, embed))
        self.w_up = nn.Parameter(torch.zeros(el, mlp, embed))
        self.w_down = nn.Parameter(torch.zeros(el, embed, mlp))

    def load(self, full: dict) -> None:
        """Copy this rank's share of the whole layer's weights ``full`` (name -> tensor)."""
        el = self.experts // self.n
        with torch.no_grad():
            self.router.copy_(full["router"])
            for k in ("w_gate", "w_up", "w_down"):
                getattr(self, k).copy_(full[k][self.r * el : (self.r + 1) * el])

    def capacity(self, seq: int) -> int:
        if self.cap_factor is None:
            return seq  # dropless: no expert gets more than every token once
        return max(1, min(seq, math.ceil(self.cap_factor * self.top_k * seq / self.experts)))

    def forward(self, x, group):
        b, s, d = x.shape
        logits = F.linear(x.float(), self.router.float())
        dispatch, combine = route(logits, self.top_k, self.capacity(s))
        xe = torch.einsum("bsec,bsd->becd", dispatch, x)  # (b, E, C, d)
        n, el = self.n, self.experts // self.n
        if n > 1:  # slice j of the expert dim to ep rank j; receive every rank's rows for ours
            xe = _AllToAll.apply(xe.unflatten(1, (n, el)).transpose(0, 1), group)  # (n: from, b, el, C, d)
            xe = xe.flatten(0, 1)  # (n*b, el, C, d)
        h = F.silu(torch.einsum("becd,emd->becm", xe, self.w_gate)) * torch.einsum("becd,emd->becm", xe, self.w_up)
        ye = torch.einsum("becm,edm->becd", h, self.w_down)
        if n > 1:  # each source's rows back to it
            ye = _AllToAll.apply(ye.unflatten(0, (n, b)), group)  # (n: experts of, b, el, C, d)
            ye = ye.transpose(0, 1).flatten(1, 2)  # (b, E, C, d)
        return torch.einsum("bsec,becd->bsd", combine, ye)


class MoEStack(nn.Module):
    """``layers`` residual MoE layers; ``forward`` returns this rank's summed squared error
    over ``count`` (the global number of elements), so the sum over ranks is the mean."""

    def __init__(self, embed, mlp, experts, top_k, layers, cap_factor, n=1, r=0):
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(embed, mlp, experts, top_k, cap_factor, n, r) for _ in range(layers))

    def forward(self, x, y, count, group=None):
        for m in self.layers:
            x = x + m(x, group)
        return (x - y).pow(2).sum() / count


def allreduce_grads(model: MoEStack, world, dp_group) -> None:
    """The router's gradients summed over the world, the experts' over ``dp_group`` (the ranks
    holding the same experts; None: each rank holds its own alone)."""
    groups = [(world, [m.router for m in model.layers])]
    if dp_group is not None:
        groups.append((dp_group, [p for m in model.layers for p in (m.w_gate, m.w_up, m.w_down)]))
    for group, ps in groups:
        flat = torch.cat([p.grad.flatten() for p in ps])
        SENT[0] += _wire("all_reduce", flat.numel() * flat.element_size(), dist.get_world_size(group))
        dist.all_reduce(flat, group=group)
        i = 0
        for p in ps:
            p.grad.copy_(flat[i : i + p.numel()].view_as(p))
            i += p.numel()
