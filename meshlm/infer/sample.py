"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and
top-p from a seeded generator (the same draw on every rank, which all hold the same logits)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from meshlm.core.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """``temperature=0``: greedy (argmax).  Otherwise logits / temperature, then only the
    ``top_k`` most likely tokens (0: all), then the smallest set whose probability reaches
    ``top_p`` (1.0: all), sampled with a generator seeded by ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"sampling.temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"sampling.top_k={self.top_k} must be a whole number >= 0 (0 keeps every token)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p={self.top_p} must be in (0, 1] (1 keeps every token)")

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Sampling":
        known = [f.name for f in dataclasses.fields(cls)]
        for k in d or {}:
            if k not in known:
                raise ConfigError(f"sampling.{k}: no such sampling option; the options are {', '.join(known)}")
        return cls(**(d or {}))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: Tensor, s: Sampling) -> Tensor:
    """``logits`` (rows, vocab) in float32, divided by the temperature, with the tokens that
    top-k and top-p leave out set to -inf."""
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= s.top_p  # the mass before a token already reaches top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s stream under ``seed`` (NOTE [row streams])."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest(), "little") >> 1


def generators(s: Sampling, rows: "int | list[int]") -> Optional[list[torch.Generator]]:
    """NOTE [row streams]
    One generator per row, row ``i`` seeded from ``(s.seed, i)`` (``row_seed``, a hash of
    both): each prompt of a batch draws from its own stream, so two prompts under one
    ``--seed`` do not take the same random draws (they did, and continued alike), and
    prompt ``i`` draws the same whatever the other prompts are.  ``rows``: how many (their
    indices 0, 1, ...), or the indices themselves.  None when greedy."""
    if s.greedy:
        return None
    index = range(rows) if isinstance(rows, int) else rows
    return [torch.Generator().manual_seed(row_seed(s.seed, i)) for i in index]


def choose(logits: Tensor, s: Sampling, gens: Optional[list[torch.Generator]]) -> Tensor:
    """The next token of each row of ``logits`` (rows, vocab), row ``i`` drawn with ``gens[i]``."""
    if s.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, s).softmax(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
