"""One block of attention on local tensors, forward and backward, and the logsumexp merge of
blocks (NOTE [cp attention] in meshlm/runtime/cp/ring.py).

``block_forward`` returns a block's output and the float32 logsumexp of its scaled scores;
``block_backward`` takes the *global* output and logsumexp of those query rows (over every
key they attend, on every rank) and returns the block's exact share of dq, dk, dv: softmax's
backward needs ``P = exp(scores - lse)`` and ``D = rowsum(dout * out)``, both of which the
global out and lse give block by block.  Grouped-query inputs (fewer key/value heads) are
taken as they are; dk and dv come back with the key/value heads.

On CPU tensors both run torch's flash attention kernel where torch has it
(``meshlm._torch_compat.cpu_flash_attention``); elsewhere, or with ``math=True``, a plain
matmul/softmax in float32 that repeats the key/value heads locally.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshlm import _torch_compat as compat


def _flash(t: Tensor, math: bool):
    return None if math or t.device.type != "cpu" else compat.cpu_flash_attention()


def _repeat_kv(k: Tensor, v: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, math: bool = False):
    """``(out in q's dtype, lse float32 (b, hq, sq))`` of ``q`` (b, hq, sq, d) against ``k``,
    ``v`` (b, hkv, sk, d); ``causal`` needs ``sq == sk``."""
    flash = _flash(q, math)
    if flash is not None:
        out, lse = flash[0](q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    k, v = _repeat_kv(k, v, q.shape[1] // k.shape[1])
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float, *, math=False
):
    """This block's ``(dq, dk, dv)`` given the global ``out`` and ``lse`` of its query rows
    (dk, dv with ``k``'s heads)."""
    flash = _flash(q, math)
    if flash is not None:
        return flash[1](dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    hkv = k.shape[1]
    groups = q.shape[1] // hkv
    kr, vr = _repeat_kv(k, v, groups)
    p = torch.exp(_scores(q, kr, causal, scale) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, vr.float().transpose(-2, -1))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kr.float()) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    if groups > 1:  # the repeated heads' gradients add up on the head they were copied from
        b, _, sk, d = k.shape
        dk = dk.view(b, hkv, groups, sk, d).sum(2)
        dv = dv.view(b, hkv, groups, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's ``(block_out, block_lse)`` for query ``rows`` into the float32 running
    ``out`` (b, h, s, d) and ``lse`` (b, h, s), in place: the online softmax.  A row no block
    has reached yet holds lse = -inf and out = 0, so its first block is taken as it is."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - new).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - new
    ).unsqueeze(-1)
    lse[:, :, rows] = new
