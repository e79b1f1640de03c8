"""Gathering a bucket's members to compute, with the next block's gather issued early.

NOTE [prefetch]
    With ``overlap`` in eager mode, a bucket that has issued its own gather issues the
    first gather of the block that runs next (the next block in forward, the previous one
    when backward re-gathers blocks), so that it is in flight during this block's compute;
    that block then consumes it instead of gathering.  Only the first (innermost) gather
    step is prefetched; a prefetch is used only if the shards it read are unchanged
    (same storage and version), and a stale one is waited for and dropped.  Every rank
    runs the same code, so the collectives keep one order on every rank.  Local blocks only
    (NOTE [local blocks]): they re-gather by freeing (NOTE [free and re-gather]) or by a
    plain recompute, whereas the selective checkpointing that DTensor blocks may run under
    matches ops by their count, and a prefetch issued inside one block's region (forward:
    the next block's; recompute: the previous one's) would shift it.
    The blocks' order and the gathers in flight are the model's (``Prefetch``, owned by its
    ShardState), named by the block's position in forward order; the lowering says which
    model and block a gather belongs to with the run state's ``site`` (``scope(site=...)``,
    NOTE [run state] in meshlm/core/state.py; eager code only).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.runtime.bucket.flat import by_dtype, gather_flat, issue_gather, waited
from meshlm.runtime.bucket.spec import BUCKETS, Bucket
from meshlm.runtime.memory import where


class Prefetch:
    """One sharded model's prefetch state (NOTE [prefetch]): its blocks in forward order,
    the gathers in flight by block position, and counters (``stats``)."""

    def __init__(self) -> None:
        self.order: list[tuple[int, Callable[[], list]]] = []  # (bucket key, stored parameters) per block
        self.inflight: dict[int, tuple[tuple, list[Tensor]]] = {}  # position -> (stamp of the shards, flats)
        self.stats = {"issued": 0, "used": 0, "stale": 0}

    def link(self, keys: Sequence[int], params: Sequence[Callable[[], list]]) -> None:
        """Record the blocks' order (forward order): ``keys[n]`` is block n's bucket,
        ``params[n]()`` its stored parameters in member order."""
        self.order = list(zip(keys, params))

    def take(self, pos: int, params) -> Optional[list[Tensor]]:
        got = self.inflight.pop(pos, None)
        if got is None:
            return None
        stamp, flats = got
        if stamp != _stamp(params):
            for f in flats:
                waited(f)
            self.stats["stale"] += 1
            return None
        self.stats["used"] += 1
        return flats

    def issue_neighbour(self, pos: int) -> None:
        self.issue(pos - 1 if compat.in_backward() else pos + 1)

    def issue(self, nxt: int) -> None:
        """Issue the first gather of block ``nxt`` now, unless one is in flight already."""
        if not 0 <= nxt < len(self.order) or nxt in self.inflight:
            return
        key, get = self.order[nxt]
        params = get()
        b = BUCKETS[key]
        with torch.no_grad():
            xs = compute_locals(b, params)
            steps = gather_steps(b, xs)
            if steps:
                i, groups = steps[0]
                self.inflight[nxt] = (
                    _stamp(params),
                    [issue_gather([xs[j] for j in grp], b.groups[i]) for grp in groups],
                )
                self.stats["issued"] += 1

    def drain(self) -> None:
        """Wait for every gather still in flight and drop it (issued ahead, never taken)."""
        for _stamp_, flats in self.inflight.values():
            for f in flats:
                waited(f)
            self.stats["stale"] += 1
        self.inflight.clear()


# (the model's Prefetch, the block's position), None: no prefetch; the run state's ``site``
Site = Optional[tuple[Prefetch, int]]


def _stamp(params) -> tuple:
    return tuple((where(compat.local_tensor(p)), compat.local_tensor(p)._version) for p in params)


def compute_locals(b: Bucket, params) -> list[Tensor]:
    xs = [compat.local_tensor(p) for p in params]
    if b.compute_dtype is not None:
        xs = [x if x.dtype == b.compute_dtype else x.to(b.compute_dtype) for x in xs]
    return xs


def gather_steps(b: Bucket, xs: list[Tensor]) -> list[tuple[int, list[list[int]]]]:
    """(mesh dim, member groups of one flat buffer each) per gather step, inner dim first."""
    out = []
    for i in sorted({i for m in b.members for i, _ in m.gather if b.sizes[i] > 1}, reverse=True):
        idx = [j for j, m in enumerate(b.members) if any(mi == i for mi, _ in m.gather)]
        out.append((i, by_dtype(idx, xs)))
    return out


def gather_locals(b: Bucket, params, site: Site, neighbour: bool = True) -> list[Tensor]:
    """The local tensors of the block's parameters in compute placements (gathered over the
    data axes), using a prefetch at ``site`` and, with ``neighbour``, issuing the next
    block's (None: none; NOTE [prefetch])."""
    pre = site[0].take(site[1], params) if site is not None else None
    xs = compute_locals(b, params)
    for n_step, (i, groups) in enumerate(gather_steps(b, xs)):
        for g, grp in enumerate(groups):
            dims = [dict(b.members[j].gather)[i] for j in grp]
            issued = pre[g] if pre is not None and n_step == 0 else None
            for j, y in zip(grp, gather_flat([xs[j] for j in grp], dims, b.groups[i], b.sizes[i], issued)):
                xs[j] = y
        if n_step == 0 and site is not None and neighbour:
            site[0].issue_neighbour(site[1])
    return xs
