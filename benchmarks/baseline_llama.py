"""The hand-written torch baseline: the same Llama as meshlm's, written with nn.Linear the
way torchtitan writes its model, and parallelised with torch's own APIs the way torchtitan
does it (``parallelize_module`` with Colwise/Rowwise/SequenceParallel and ``loss_parallel``
for tensor parallel; ``fully_shard`` (FSDP2) per block for ZeRO-3; DDP for data parallel).

Same math as ``meshlm.models.llama``: RMSNorm, RoPE rotate-half, SwiGLU, grouped-query
attention through SDPA, untied output head, mean next-token cross-entropy.  Weights are
copied from a one-device meshlm ``Llama`` (``load_from_meshlm``), so both start from the
same initialisation and the same loss.  Not part of the meshlm package: a benchmark only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def _rope(x: Tensor, theta: float) -> Tensor:
    """Rotate halves. x: (batch, heads, seq, head_dim), a plain (local) tensor."""
    s, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat([-x2, x1], -1) * sin2


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hd, self.theta = cfg.hd, cfg.rope_theta
        self.rep = cfg.heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.embed, cfg.heads * cfg.hd, bias=False)
        self.wk = nn.Linear(cfg.embed, cfg.kv_heads * cfg.hd, bias=False)
        self.wv = nn.Linear(cfg.embed, cfg.kv_heads * cfg.hd, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.hd, cfg.embed, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        # -1: the local number of heads under tensor parallel (torchtitan's idiom)
        q = self.wq(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        q, k = _rope(q, self.theta), _rope(k, self.theta)
        if self.rep > 1:
            k = k.repeat_interleave(self.rep, dim=1)
            v = v.repeat_interleave(self.rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.embed, cfg.mlp, bias=False)  # gate
        self.w3 = nn.Linear(cfg.embed, cfg.mlp, bias=False)  # up
        self.w2 = nn.Linear(cfg.mlp, cfg.embed, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.embed, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.embed, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class BaselineLlama(nn.Module):
    """``forward(tokens)`` -> logits (batch, seq, vocab)."""

    def __init__(self, cfg):
        super().__init__()
        assert not cfg.tie_embeddings
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.embed)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.embed, cfg.norm_eps)
        self.output = nn.Linear(cfg.embed, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@torch.no_grad()
def load_from_meshlm(base: BaselineLlama, ref) -> BaselineLlama:
    """Copy the weights of a one-device ``meshlm.models.Llama`` (3-D attention weights are
    reshaped to the 2-D nn.Linear weights they equal)."""
    base.tok_embeddings.weight.copy_(ref.tok_emb)
    base.output.weight.copy_(ref.lm_head)
    base.norm.weight.copy_(ref.norm.weight)
    for b, r in zip(base.layers, ref.layers):
        b.attention_norm.weight.copy_(r.attn_norm.weight)
        b.ffn_norm.weight.copy_(r.mlp_norm.weight)
        b.attention.wq.weight.copy_(r.attn.wq.flatten(0, 1))
        b.attention.wk.weight.copy_(r.attn.wk.flatten(0, 1))
        b.attention.wv.weight.copy_(r.attn.wv.flatten(0, 1))
        b.attention.wo.weight.copy_(r.attn.wo.flatten(1, 2))
        b.feed_forward.w1.weight.copy_(r.mlp.w_gate)
        b.feed_forward.w3.weight.copy_(r.mlp.w_up)
        b.feed_forward.w2.weight.copy_(r.mlp.w_down)
    return base


def apply_tp(model: BaselineLlama, tp_mesh, sequence_parallel: bool) -> None:
    """Megatron tensor parallel (+ sequence parallel), as torchtitan's Llama plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    act = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: BaselineLlama, dp_mesh, reshard_after_forward: bool = True, mp_policy=None) -> None:
    """FSDP2 per block, then the root (embedding, final norm, output head), as torchtitan
    (``mp_policy``: a ``MixedPrecisionPolicy``; None: fully_shard's default, fp32)."""
    from torch.distributed.fsdp import fully_shard

    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
    # The root is used last in forward and first in backward: torchtitan keeps it gathered.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **kw)


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy.  Vocab-sharded DTensor logits need the caller to run
    forward and backward inside ``torch.distributed.tensor.parallel.loss_parallel()``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
