"""Which sequence chunks a context-parallel rank holds, and which blocks of attention it
computes against the keys and values of another rank (NOTE [cp attention] in
meshlm/runtime/cp/ring.py).

A rank's local sequence (``s`` tokens of a global ``S = n*s``):

- unbalanced: the contiguous global tokens ``[r*s, (r+1)*s)``;
- balanced (causal load balancing): the sequence cut into ``2n`` chunks of ``c = s/2``
  tokens, rank ``r`` holding chunk ``r`` followed by chunk ``2n-1-r``.

Either way a rank's global positions increase along its local sequence, so the causal mask
of a rank's queries against its own keys is the lower triangle of the local square.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def local_positions(rank: int, n: int, seq_len: int, balanced: bool) -> Tensor:
    """The global positions (int64, ``seq_len // n`` of them) of rank ``rank``'s local tokens
    out of ``seq_len``, in local order: what RoPE or a position embedding must be given, and
    which tokens the input loader feeds the rank."""
    if seq_len % (2 * n if balanced else n):
        raise ValueError(
            f"context parallel: sequence length {seq_len} is not divisible by "
            f"{'2 x ' if balanced else ''}cp = {2 * n if balanced else n}"
            f"{' (load balancing cuts it into 2 x cp chunks)' if balanced else ''}; pick a multiple"
        )
    s = seq_len // n
    if not balanced:
        return torch.arange(rank * s, (rank + 1) * s)
    c = s // 2
    tail = 2 * n - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


class Block(NamedTuple):
    """Local query rows ``q`` attend local key rows ``kv`` of a source rank, with the lower
    triangular (``causal``) mask or none.  Rows are slices of the local sequence."""

    q: slice
    kv: slice
    causal: bool


_ALL = slice(None)


def blocks(rank: int, src: int, n: int, s: int, *, causal: bool, balanced: bool) -> list[Block]:
    """The blocks rank ``rank``'s queries compute against rank ``src``'s keys and values
    (``s`` local tokens each), skipping every fully masked pair.  Causal and balanced, with
    ``c = s/2``: own keys are the lower triangle (chunk ``2n-1-r`` sees chunk ``r`` whole, chunk
    ``r`` sees none of chunk ``2n-1-r``); an earlier rank's head chunk is seen whole by both
    query chunks and its tail by neither; a later rank's two chunks are seen whole by the
    tail query chunk only.  So every rank computes the same area at every step but its own."""
    if not causal:
        return [Block(_ALL, _ALL, False)]
    if src == rank:
        return [Block(_ALL, _ALL, True)]
    if not balanced:
        return [Block(_ALL, _ALL, False)] if src < rank else []
    c = s // 2
    if src < rank:
        return [Block(_ALL, slice(0, c), False)]
    return [Block(slice(c, s), _ALL, False)]
