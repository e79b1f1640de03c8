"""The key/value cache of incremental decoding.

NOTE [KV cache]
    A model that supports decoding takes ``forward(tokens, cache=cache)``, reads the
    positions of this call's tokens (for RoPE or learned positions) from
    ``cache.positions`` (batch, new), and hands block ``i`` the view ``cache.layer(i)``, whose
    ``update(k, v)`` stores this call's keys and values and returns every position's so far;
    the block attends to those with ``attn_mask=view.mask`` and ``is_causal=view.causal``.
    Optionally, where ``cache.last_only`` is set (the generate loop sets it), the model may
    compute its output head at the last position only: a prefill's logits of every prompt
    position are otherwise the largest tensor of a generate call (8 rows of 4,096 tokens
    over a 128k vocabulary: 8 GB in bf16).
    That is the whole contract: the model imports nothing from here (meshlm/models/llama.py
    and gpt2.py follow it).

    The caller (meshlm/infer/generate.py) brackets each forward with ``begin(valid)`` and
    ``end()``.  ``valid`` says which of the new tokens are real: prompts of different lengths
    are left-padded, and a pad slot is never attended to (a pad query attends to itself
    only, so no softmax row is empty and no NaN reaches a real row).  A real token's position
    counts the real tokens before it, so a padded row computes what the same prompt alone
    would, as Hugging Face's ``generate`` does with an attention mask.

    One buffer pair per layer, allocated at the first update from the keys' own shape, for
    ``max_len`` positions.  Under a tensor-parallel layout the keys arrive as DTensors
    sharded over ``kv_heads``: the buffer holds this rank's heads only (``1/tp`` of one
    device's bytes, ``nbytes()``) and the keys go back out as a DTensor of the same
    placements, so nothing about the cache is communicated.

    NOTE [static cache]: with ``static=True`` the keys returned are all ``max_len`` slots and
    the mask hides those not written yet (and pads), and this call's keys are written at the
    positions of a tensor (``index_copy_``), not of a Python slice: a forward's shapes and the
    Python values it reads are then the same at every position, and nothing in it depends on
    the data (what gpt-fast compiles, and what CUDA graphs need).  meshlm's placement runs it
    on the meta device (placement.py); generate compiles the default cache with dynamic
    shapes instead, which reads only the written slots (NOTE [compiled decode] in
    compiled.py).

    The object is handed to the sharded model's forward as it is (``__meshlm_passthrough__``,
    meshlm/core/tree.py): its tensors are placed by the cache, not by the input rules.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm.core.errors import ConfigError


class KVCache:
    """Keys and values of up to ``max_len`` positions for a batch of ``batch`` rows."""

    __meshlm_passthrough__ = True

    def __init__(self, batch: int, max_len: int, device=None, static: bool = False, last_only: bool = False):
        """``static``: every forward attends over all ``max_len`` slots (those not yet
        written masked), with the same shapes at every position (NOTE [static cache]);
        otherwise over the slots written so far."""
        if batch < 1 or max_len < 1:
            raise ConfigError(f"KVCache: batch={batch} and max_len={max_len} must be positive")
        self.batch, self.max_len, self.static, self.last_only = batch, max_len, static, last_only
        self.device = torch.device(device or "cpu")
        self.length = 0  # positions filled (pads included)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}
        self._chunk: Optional[int] = None  # tokens in the forward between begin and end
        self.positions: Optional[Tensor] = None
        self.mask: Optional[Tensor] = None
        self.causal = False

    def begin(self, valid: Tensor) -> None:
        """Before a forward of ``valid.shape[1]`` new tokens per row; ``valid[b, j]`` is
        False where token ``j`` of row ``b`` is padding."""
        b, s = valid.shape
        p = self.length
        if b != self.batch:
            raise ConfigError(f"KVCache: a batch of {b} rows fed to a cache made for {self.batch}")
        if p + s > self.max_len:
            raise ConfigError(
                f"KVCache: {p} positions cached + {s} new = {p + s}, more than the cache's max_len={self.max_len}"
            )
        self.valid[:, p : p + s] = valid.to(self.device, torch.bool)
        seen = self.valid[:, : p + s]
        self.positions = (seen.long().cumsum(-1)[:, p:] - 1).clamp(min=0)
        self._chunk = s
        if self.static:
            self.input_pos = torch.arange(p, p + s, device=self.device)
            self.mask, self.causal = self._mask(self.valid, p, s), False
        elif bool(seen.all()):
            # No padding: a first chunk is plainly causal, one new token sees everything.
            self.mask, self.causal = None, (p == 0 and s > 1)
            if p > 0 and s > 1:
                self.mask = self._mask(seen, p, s)
        else:
            self.mask, self.causal = self._mask(seen, p, s), False

    def _mask(self, seen: Tensor, p: int, s: int) -> Tensor:
        keys = torch.arange(seen.shape[1], device=self.device)
        query = torch.arange(p, p + s, device=self.device)
        m = (keys[None, None, :] <= query[None, :, None]) & seen[:, None, :]
        m |= keys[None, None, :] == query[None, :, None]  # a pad query sees itself
        return m[:, None]  # (batch, 1, new, cached + new): broadcast over heads

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's keys and values ``(batch, kv_heads, new, head_dim)`` of
        ``layer``; return every position's so far."""
        if self._chunk is None:
            raise RuntimeError("KVCache.update outside begin()/end(): the generate loop brackets each forward")
        kl, vl = _local(k), _local(v)
        if layer not in self._kv:
            shape = (kl.shape[0], kl.shape[1], self.max_len, kl.shape[3])
            self._kv[layer] = (kl.new_zeros(shape), vl.new_zeros(shape[:3] + (vl.shape[3],)))
        kb, vb = self._kv[layer]
        if self.static:  # written at tensor positions: nothing here depends on a Python int that changes
            kb.index_copy_(2, self.input_pos, kl)
            vb.index_copy_(2, self.input_pos, vl)
            return _like(k, kb), _like(v, vb)
        p, s = self.length, self._chunk
        kb[:, :, p : p + s] = kl
        vb[:, :, p : p + s] = vl
        return _like(k, kb[:, :, : p + s]), _like(v, vb[:, :, : p + s])

    def layer(self, i: int) -> "LayerCache":
        """What block ``i`` of the model sees of the cache."""
        return LayerCache(self, i)

    def end(self) -> None:
        """After the forward: the new tokens are cached."""
        self.length += self._chunk
        self._chunk = None

    def nbytes(self) -> int:
        """Bytes of this rank's key and value buffers."""
        return sum(t.numel() * t.element_size() for kv in self._kv.values() for t in kv)


class LayerCache:
    """One layer's view of a :class:`KVCache` (NOTE [KV cache])."""

    __meshlm_passthrough__ = True

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(self.i, k, v)

    @property
    def mask(self) -> Optional[Tensor]:
        return self.cache.mask

    @property
    def causal(self) -> bool:
        return self.cache.causal

    @property
    def positions(self) -> Tensor:
        return self.cache.positions


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(ref: Tensor, local: Tensor) -> Tensor:
    """``local`` as a DTensor placed like ``ref`` (its global length along dim 2 is the local one's)."""
    if not isinstance(ref, DTensor):
        return local
    shape = list(ref.shape)
    shape[2] = local.shape[2]
    return DTensor.from_local(
        local,
        ref.device_mesh,
        ref.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
