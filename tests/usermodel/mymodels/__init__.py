"""A user's models, in a package of their own outside meshlm (``mymodels``, on PYTHONPATH),
written with ``meshlm.nn`` as docs/model.md describes, and trained with
``meshlm train model._target_=mymodels.TinyLM model.width=32`` with no change to meshlm.

``TinyLM`` keeps the contract; ``SharedUp`` shares one module between its blocks; the
others each break one clause of it, for the tests of the errors that say so.  Plain
PyTorch models (torch's layers, weights made in ``__init__``) are in ``mymodels.plain``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm import nn as mnn


class Attention(nn.Module):
    """Causal self-attention; q, k, v and o as plain Linears over the heads axis."""

    def __init__(self, width: int, heads: int, device=None):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (
            mnn.Linear(width, width, bias=False, axes=("embed", "heads"), init_std=0.02, device=device)
            for _ in range(3)
        )
        self.o = mnn.Linear(width, width, bias=False, axes=("heads", "embed"), init_std=0.02, device=device)

    def forward(self, x):  # x: (batch, seq, embed)
        b, t, d = x.shape
        x = meshlm.constrain(x, ("batch", None, "embed"))  # every position: tensor parallel needs them
        q, k, v = (
            meshlm.constrain(
                lin(x).view(b, t, self.heads, d // self.heads).transpose(1, 2), ("batch", "heads", None, "head_dim")
            )
            for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = meshlm.constrain(y, ("batch", "heads", None, "head_dim")).transpose(1, 2).flatten(2, 3)
        return meshlm.constrain(self.o(y), ("batch", "seq", "embed"))


@meshlm.block
class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int, device=None):
        super().__init__()
        self.norm1 = mnn.LayerNorm(width, device=device)
        self.attn = Attention(width, heads, device)
        self.norm2 = mnn.LayerNorm(width, device=device)
        self.up = mnn.Linear(width, mlp, axes=("embed", "mlp"), init_std=0.02, device=device)
        self.down = mnn.Linear(mlp, width, axes=("mlp", "embed"), init_std=0.02, device=device)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = meshlm.constrain(self.norm2(x), ("batch", None, "embed"))
        h = meshlm.constrain(F.gelu(self.up(h)), ("batch", None, "mlp"))
        return meshlm.constrain(x + self.down(h), ("batch", "seq", "embed"))


class TinyLM(nn.Module):
    """A small decoder: ``forward(tokens, targets)`` is the mean next-token cross-entropy."""

    def __init__(self, vocab: int = 256, width: int = 32, depth: int = 2, heads: int = 4, mlp: int = 64, device=None):
        super().__init__()
        self.wte = mnn.Embedding(vocab, width, axes=("vocab", "embed"), init_std=0.02, device=device)
        self.blocks = nn.ModuleList(Block(width, heads, mlp, device) for _ in range(depth))
        self.norm = mnn.LayerNorm(width, device=device)
        self.head = mnn.Linear(width, vocab, bias=False, axes=("embed", "vocab"), init_std=0.02, device=device)

    def forward(self, tokens, targets):
        x = meshlm.constrain(self.wte(tokens), ("batch", "seq", "embed"))
        for blk in self.blocks:
            x = blk(x)
        x = meshlm.constrain(self.norm(x), ("batch", None, "embed"))
        logits = meshlm.constrain(self.head(x), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class NoDevice(TinyLM):
    """Takes no ``device``: meshlm builds it inside ``with torch.device("meta")``."""

    def __init__(self, width: int = 32):
        super().__init__(width=width)


def not_a_model(width: int = 32, device=None):
    """Returns a tensor, not an ``nn.Module``."""
    return torch.zeros(width, device=device)


class LogitsOnly(TinyLM):
    """Its forward returns the logits, not a loss."""

    def forward(self, tokens, targets):
        x = meshlm.constrain(self.wte(tokens), ("batch", "seq", "embed"))
        return meshlm.constrain(self.head(x), ("batch", "seq", "vocab"))


class Unannotated(TinyLM):
    """A parameter without logical axes."""

    def __init__(self, width: int = 32, device=None):
        super().__init__(width=width, device=device)
        self.scale = nn.Parameter(torch.ones(width, device=device))


class SharedUp(TinyLM):
    """``blocks.1.up`` is ``blocks.0.up``: one module registered in two blocks (one weight
    under a layout without pp; an error under pipeline stages, which would copy it)."""

    def __init__(self, width: int = 32, device=None):
        super().__init__(width=width, device=device)
        self.blocks[1].up = self.blocks[0].up
