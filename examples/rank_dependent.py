"""A model with a bug that only shows when it runs on more than one rank (docs/diff.md):
its third block adds a little of the process's rank to its output, as a model that reads
``torch.distributed.get_rank()`` (or a per-rank buffer, or an unseeded random number) in its
forward would.  On one device it trains as well as any; under a data-parallel layout each
rank's rows go their own way from that block on.

    PYTHONPATH=examples meshlm diff model._target_=rank_dependent.RankDependentLM \\
        a.layout=ddp a.mesh=dp2 b.layout=single b.mesh=cpu1
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import meshlm


@meshlm.block
class Block(nn.Module):
    """A residual MLP block; block ``buggy`` adds 1e-3 x the rank to its output."""

    def __init__(self, width: int, buggy: bool):
        super().__init__()
        self.buggy = buggy
        self.norm = meshlm.set_axes(nn.LayerNorm(width), weight=("embed",), bias=("embed",))
        self.up = meshlm.set_axes(nn.Linear(width, 4 * width), weight=("mlp", "embed"), bias=("mlp",))
        self.down = meshlm.set_axes(nn.Linear(4 * width, width), weight=("embed", "mlp"), bias=("embed",))

    def forward(self, x):
        h = meshlm.constrain(F.gelu(self.up(self.norm(x))), ("batch", "seq", "mlp"))
        y = meshlm.constrain(x + self.down(h), ("batch", "seq", "embed"))
        if self.buggy and dist.is_initialized():
            y = y + 1e-3 * dist.get_rank()
        return y


class RankDependentLM(nn.Module):
    """Embedding, ``depth`` blocks (the third one buggy), a head; ``forward(tokens, targets)``
    is the mean next-token cross-entropy."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 4):
        super().__init__()
        self.emb = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.blocks = nn.ModuleList(Block(width, buggy=i == 2) for i in range(depth))
        self.head = meshlm.set_axes(nn.Linear(width, vocab, bias=False), weight=("vocab", "embed"))

    def forward(self, tokens, targets):
        x = meshlm.constrain(self.emb(tokens), ("batch", "seq", "embed"))
        for b in self.blocks:
            x = b(x)
        logits = meshlm.constrain(self.head(x), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
