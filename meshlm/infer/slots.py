"""Per-request KV cache slots for a server that decodes requests of different ages together.

NOTE [KV slots]
    A :class:`SlotCache` is the KV cache of NOTE [KV cache] (meshlm/infer/cache.py) held as
    ``slots`` independent rows of up to ``context`` positions each: one row per request in
    flight, its positions counted from 0 in its own row, whatever else is decoded beside it.
    A forward names the rows it feeds (``begin(rows, new, width)``): row ``b`` of the batch is
    slot ``rows[b]``, with its ``new[b]`` real tokens left-padded to ``width``; they are
    written after the slot's ``length`` cached positions.  A request's prompt may come in
    several such forwards (chunked prefill) and its tokens one per decode step; when it ends
    its slot is :meth:`free` again for the next request, and nothing else is copied.

    The keys a block attends to are its rows' first ``K`` positions, ``K`` the longest row's
    length after this forward; the mask hides each row's positions past its own length (a
    left-pad query attends to keys of its own row only, never an empty softmax row).  Where
    nothing needs hiding (one new token per row and every row as long; a first chunk without
    pads) the mask is None, as :class:`KVCache` gives one request alone, so a request decoded
    by itself takes the very path ``generate`` takes.  The rows a forward reads are a view of
    the buffers when they are consecutive slots in order (the scheduler hands out the lowest
    free slot, so a full batch is), else a gather of those rows' first ``K`` positions.

    The buffers grow with the longest request (doubling, up to ``context``), so a model of a
    long context does not hold ``slots x context`` positions before any request asks for
    them; a growth copies the cache once, not per step.  Under a tensor-parallel layout the
    keys arrive sharded over ``kv_heads`` and the slots hold this rank's heads only, as
    :class:`KVCache` does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from meshlm.core.errors import ConfigError
from meshlm.infer.cache import LayerCache, _like, _local

FIRST_CAPACITY = 256  # positions per slot allocated at first; doubled as requests grow


class SlotCache:
    """Keys and values of ``slots`` requests of up to ``context`` positions each."""

    __meshlm_passthrough__ = True

    def __init__(self, slots: int, context: int, device=None):
        if slots < 1 or context < 1:
            raise ConfigError(f"SlotCache: slots={slots} and context={context} must be positive")
        self.slots, self.context, self.max_len = slots, context, context
        self.device = torch.device(device or "cpu")
        self.last_only = True
        self.lengths = [0] * slots  # positions filled per slot (pads of a prefill chunk excluded)
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}
        self._rows: Optional[list[int]] = None
        self.positions: Optional[Tensor] = None
        self.mask: Optional[Tensor] = None
        self.causal = False

    def free(self, slot: int) -> None:
        """The slot's request ended: its positions are forgotten (not cleared: never read)."""
        self.lengths[slot] = 0

    def begin(self, rows: Sequence[int], new: Sequence[int], width: int) -> None:
        """Before a forward of ``width`` tokens per batch row: row ``b`` feeds slot ``rows[b]``
        its ``new[b]`` real tokens, left-padded."""
        if len(set(rows)) != len(rows) or not rows:
            raise ConfigError(f"SlotCache: rows {list(rows)} must be distinct slots, at least one")
        for s, n in zip(rows, new):
            if not 1 <= n <= width:
                raise ConfigError(f"SlotCache: slot {s} feeds {n} tokens in a forward of width {width}")
            if self.lengths[s] + n > self.context:
                raise ConfigError(
                    f"SlotCache: slot {s} holds {self.lengths[s]} positions + {n} new, more than the context of "
                    f"{self.context}"
                )
        self._rows, self._new, self._width = list(rows), list(new), width
        self._idx = torch.tensor(self._rows, device=self.device)
        self._at = torch.tensor([self.lengths[s] for s in rows], device=self.device)  # where one new token goes
        self._view = self._rows == list(range(rows[0], rows[0] + len(rows)))  # consecutive slots: a view
        old = torch.tensor([self.lengths[s] for s in rows], device=self.device)
        pad = width - torch.tensor(list(new), device=self.device)
        j = torch.arange(width, device=self.device)
        # a real token's position counts the row's cached positions and its real tokens before it
        self.positions = (old[:, None] + j[None, :] - pad[:, None]).clamp(min=0)
        totals = [self.lengths[s] + n for s, n in zip(rows, new)]
        self._keys = max(totals)
        fresh = all(self.lengths[s] == 0 for s in rows) and all(n == width for n in new)
        if fresh:  # a first chunk, no pads: plainly causal
            self.mask, self.causal = None, width > 1
        elif width == 1 and all(t == self._keys for t in totals):  # one token each, every row as long
            self.mask, self.causal = None, False
        else:
            keys = torch.arange(self._keys, device=self.device)
            # Causal within the row, which also hides its positions past its own length.  A pad
            # query's position is clamped to 0 or lies among the row's cached ones, so its row
            # of the mask is never empty (no NaN); its output is never read.
            m = keys[None, None, :] <= self.positions[:, :, None]
            self.mask, self.causal = m[:, None], False

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's keys and values ``(batch, kv_heads, width, head_dim)`` of
        ``layer`` in their slots; return the rows' first ``K`` positions (NOTE [KV slots])."""
        if self._rows is None:
            raise RuntimeError("SlotCache.update outside begin()/end(): the scheduler brackets each forward")
        kl, vl = _local(k), _local(v)
        kb, vb = self._buffers(layer, kl, vl)
        rows, width = self._rows, self._width
        if width == 1:
            kb[self._idx, :, self._at] = kl[:, :, 0]
            vb[self._idx, :, self._at] = vl[:, :, 0]
        else:
            for b, (s, n) in enumerate(zip(rows, self._new)):
                p = self.lengths[s]
                kb[s, :, p : p + n] = kl[b, :, width - n :]
                vb[s, :, p : p + n] = vl[b, :, width - n :]
        K = self._keys
        if self._view:
            ko, vo = kb[rows[0] : rows[0] + len(rows), :, :K], vb[rows[0] : rows[0] + len(rows), :, :K]
        else:
            ko, vo = kb[:, :, :K].index_select(0, self._idx), vb[:, :, :K].index_select(0, self._idx)
        return _like(k, ko), _like(v, vo)

    def _buffers(self, layer: int, kl: Tensor, vl: Tensor) -> tuple[Tensor, Tensor]:
        need = self._keys
        if layer in self._kv and self._kv[layer][0].shape[2] >= need:
            return self._kv[layer]
        cap = FIRST_CAPACITY if layer not in self._kv else self._kv[layer][0].shape[2]
        while cap < need:
            cap *= 2
        cap = min(cap, self.context)
        kb = kl.new_zeros((self.slots, kl.shape[1], cap, kl.shape[3]))
        vb = vl.new_zeros((self.slots, vl.shape[1], cap, vl.shape[3]))
        if layer in self._kv:  # grown: the cached positions move once
            ok, ov = self._kv[layer]
            kb[:, :, : ok.shape[2]] = ok
            vb[:, :, : ov.shape[2]] = ov
        self._kv[layer] = (kb, vb)
        return kb, vb

    def layer(self, i: int) -> LayerCache:
        """What block ``i`` of the model sees of the cache."""
        return LayerCache(self, i)

    def end(self) -> None:
        """After the forward: the new tokens are cached in their slots."""
        for s, n in zip(self._rows, self._new):
            self.lengths[s] += n
        self._rows = None

    def abort(self) -> None:
        """After a forward that failed: its rows' slots are freed (their requests fail)."""
        for s in self._rows or ():
            self.free(s)
        self._rows = None

    def nbytes(self) -> int:
        """Bytes of this rank's key and value buffers."""
        return sum(t.numel() * t.element_size() for kv in self._kv.values() for t in kv)
