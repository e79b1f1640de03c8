"""Two models meshlm did not shape, for context parallel (tests/dist/test_cp_models.py): plain
PyTorch with only their parameters' logical axes added (``meshlm.set_axes``), no
``meshlm.constrain`` anywhere, and ``F.scaled_dot_product_attention(is_causal=True)`` called
on their own query, key and value tensors.

``PlainGPT2``: GPT-2's shape: learned absolute positions (``wpe(torch.arange(t))`` over the
global length ``t``), a fused QKV Linear then split, LayerNorm and biases, GELU MLP, the head
tied to the token embedding.  ``RotaryLM``: its own rotary position table from
``torch.arange(t)``, separate q, k, v projections with fewer key/value heads than query heads
(``enable_gqa=True``), RMSNorm and a SwiGLU MLP.  ``MaskedGPT2`` gives its causal mask as an
``attn_mask``, which context parallel refuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshlm


def _linear(n_in: int, n_out: int, out_axis: str, in_axis: str = "embed", bias: bool = True) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=bias)
    return meshlm.set_axes(lin, weight=(out_axis, in_axis), **({"bias": (out_axis,)} if bias else {}))


def _layernorm(width: int) -> nn.LayerNorm:
    return meshlm.set_axes(nn.LayerNorm(width), weight=("embed",), bias=("embed",))


class GPT2Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = _linear(width, 3 * width, "qkv")
        self.c_proj = _linear(width, width, "embed", "heads")

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


@meshlm.block
class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = _layernorm(width)
        self.attn = GPT2Attention(width, heads)
        self.ln_2 = _layernorm(width)
        self.c_fc = _linear(width, 4 * width, "mlp")
        self.c_proj = _linear(4 * width, width, "embed", "mlp")

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT2(nn.Module):
    logical_axes = {"qkv": "queries, keys and values of every head, fused"}

    def __init__(self, vocab: int = 64, width: int = 16, heads: int = 2, depth: int = 2, block_size: int = 2048):
        super().__init__()
        self.wte = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.wpe = meshlm.set_axes(nn.Embedding(block_size, width), weight=(None, "embed"))
        self.h = nn.ModuleList(GPT2Block(width, heads) for _ in range(depth))
        self.ln_f = _layernorm(width)
        self.lm_head = meshlm.set_axes(nn.Linear(width, vocab, bias=False), weight=("vocab", "embed"))
        self.wte.weight = self.lm_head.weight
        with torch.no_grad():  # positions far apart must differ: a swapped chunk shows in the loss
            self.wpe.weight.normal_(0.0, 1.0)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def rotary(t: int, dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (t, dim/2) of the rotary embedding at positions ``0..t-1``."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    ang = torch.outer(torch.arange(t, dtype=torch.float32, device=device), inv)
    return ang.cos(), ang.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class GQAAttention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, width // heads
        self.q = _linear(width, width, "heads", bias=False)
        self.k = _linear(width, kv_heads * self.hd, "kv_heads", bias=False)
        self.v = _linear(width, kv_heads * self.hd, "kv_heads", bias=False)
        self.o = _linear(width, width, "embed", "heads", bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


@meshlm.block
class RotaryBlock(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, mlp: int):
        super().__init__()
        self.norm1 = meshlm.set_axes(nn.RMSNorm(width), weight=("embed",))
        self.attn = GQAAttention(width, heads, kv_heads)
        self.norm2 = meshlm.set_axes(nn.RMSNorm(width), weight=("embed",))
        self.gate = _linear(width, mlp, "mlp", bias=False)
        self.up = _linear(width, mlp, "mlp", bias=False)
        self.down = _linear(mlp, width, "embed", "mlp", bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RotaryLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16, heads: int = 4, kv_heads: int = 2, depth: int = 2):
        super().__init__()
        self.hd = width // heads
        self.embed = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.blocks = nn.ModuleList(RotaryBlock(width, heads, kv_heads, 2 * width) for _ in range(depth))
        self.norm = meshlm.set_axes(nn.RMSNorm(width), weight=("embed",))
        self.head = _linear(width, vocab, "vocab", bias=False)

    def forward(self, tokens, targets):
        cos, sin = rotary(tokens.shape[1], self.hd, tokens.device)
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class MaskedAttention(GPT2Attention):
    """GPT-2's attention with its causal mask given as an explicit boolean ``attn_mask``, as
    some ports write it: context parallel refuses it, naming this module."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MaskedGPT2(PlainGPT2):
    """``PlainGPT2`` whose blocks' attention is ``MaskedAttention``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for blk in self.h:
            blk.attn.__class__ = MaskedAttention
