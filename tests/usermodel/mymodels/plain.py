"""Plain PyTorch models, as people bring them: torch's own layers with their own init, real
weights made in ``__init__``, no ``init_weights``; only their logical axes are added
(``meshlm.set_axes``).  ``meshlm train model._target_=mymodels.plain.PlainLM`` builds them
whole on the host from ``train.seed`` (NOTE [model build] in meshlm/app/model_plain.py).

``PlainLM`` has every kind of buffer (NOTE [buffers] in meshlm/runtime/lowering/buffers.py): a fixed
sinusoidal table computed in ``__init__``, running statistics updated in forward (a mean
and a counter), and a non-persistent causal mask.  ``SharedLM`` registers one ``nn.Linear``
in both of its blocks.  ``TableLM`` builds on the meta device: its ``init_weights`` fill
its parameters and its positional table.  ``HugeLM`` is too large to build on any host.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import meshlm


def sinusoid(seq: int, width: int) -> torch.Tensor:
    """The (seq, width) sinusoidal position table of "Attention is all you need"."""
    pos = torch.arange(seq, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)


@meshlm.block
class Block(nn.Module):
    """LayerNorm, then a two-layer MLP, residual; ``up`` may be given (shared)."""

    def __init__(self, width: int, mlp: int, up: nn.Linear | None = None):
        super().__init__()
        self.norm = meshlm.set_axes(nn.LayerNorm(width), weight=("embed",), bias=("embed",))
        self.up = (
            up if up is not None else meshlm.set_axes(nn.Linear(width, mlp), weight=("mlp", "embed"), bias=("mlp",))
        )
        self.down = meshlm.set_axes(nn.Linear(mlp, width), weight=("embed", "mlp"), bias=("embed",))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))  # a fixed table inside a block

    def forward(self, x):
        h = meshlm.constrain(F.gelu(self.up(self.norm(x))), ("batch", "seq", "mlp"))
        return meshlm.constrain(x + self.down(h) * self.gain, ("batch", "seq", "embed"))


class PlainLM(nn.Module):
    """Embedding plus a sinusoidal table, a causal running-average mix over positions, MLP
    blocks, a head: ``forward(tokens, targets)`` is the mean next-token cross-entropy.  In
    training it updates ``running_mean`` (the embeddings' mean) and ``batches``; in eval it
    centres the embeddings with it (as BatchNorm uses its running statistics)."""

    def __init__(self, vocab: int = 256, width: int = 32, mlp: int = 64, depth: int = 2, seq: int = 16):
        super().__init__()
        self.wte = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.blocks = nn.ModuleList(self.block(width, mlp, i) for i in range(depth))
        self.norm = meshlm.set_axes(nn.LayerNorm(width), weight=("embed",), bias=("embed",))
        self.head = meshlm.set_axes(nn.Linear(width, vocab, bias=False), weight=("vocab", "embed"))
        self.register_buffer("pos", sinusoid(seq, width))
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))
        mask = torch.tril(torch.ones(seq, seq))
        self.register_buffer("mix", mask / mask.sum(-1, keepdim=True), persistent=False)

    def block(self, width: int, mlp: int, i: int) -> nn.Module:
        return Block(width, mlp)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.pos[:t]
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
                self.batches += 1
        else:
            x = x - self.running_mean
        x = meshlm.constrain(x + self.mix[:t, :t] @ x, ("batch", "seq", "embed"))
        for blk in self.blocks:
            x = blk(x)
        logits = meshlm.constrain(self.head(self.norm(x)), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class SharedLM(PlainLM):
    """One ``nn.Linear`` (``blocks.0.up``) registered in both blocks, as ``blocks.1.up`` too:
    one weight, used twice, its gradient the sum of both uses."""

    def block(self, width: int, mlp: int, i: int) -> nn.Module:
        if i == 0:
            self._up = meshlm.set_axes(nn.Linear(width, mlp), weight=("mlp", "embed"), bias=("mlp",))
        return Block(width, mlp, up=self._up)


class TableLM(nn.Module):
    """Built on the meta device: each module's ``init_weights`` fills its own parameters
    and buffers (the positional table here), so it initialises shard by shard."""

    param_axes = {"wte": ("vocab", "embed"), "head": ("vocab", "embed")}

    def __init__(self, vocab: int = 256, width: int = 32, seq: int = 16, device=None):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(vocab, width, device=device))
        self.head = nn.Parameter(torch.empty(vocab, width, device=device))
        self.register_buffer("pos", torch.empty(seq, width, device=device))

    def init_weights(self, generator: torch.Generator) -> None:
        nn.init.normal_(self.wte, std=0.5, generator=generator)
        nn.init.normal_(self.head, std=0.1, generator=generator)
        self.pos.copy_(sinusoid(*self.pos.shape))

    def forward(self, tokens, targets):
        x = meshlm.constrain(F.embedding(tokens, self.wte) + self.pos[: tokens.shape[1]], ("batch", "seq", "embed"))
        logits = meshlm.constrain(F.linear(x, self.head), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class HugeLM(PlainLM):
    """A plain model of 2**40 embedding rows (4 TiB of fp32 per width unit): no host builds it."""

    def __init__(self, width: int = 32):
        super().__init__(vocab=2**40, width=width)
