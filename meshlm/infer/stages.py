"""A placement over several processes: each runs its own blocks, pipeline-style, in order.

NOTE [staged decoding]
    Every rank runs the model's whole forward (so any model that meets the KV cache contract
    works, whatever it does around its blocks); the parameters outside blocks are on every
    rank.  An outer block's call is replaced (its class becomes ``Staged<its class>``): on
    the rank that owns the block (placement ``owner``) it runs; elsewhere it is skipped and
    hands its input on, a stand-in of the same shape (a block maps the hidden state to one
    of the same shape; one that does not is an error).  After the last block of each rank's
    stage the owner broadcasts its output to every rank, which continues from it; so the
    head runs everywhere on the same hidden state, every rank draws the same token, and a
    decode step moves one hidden state per stage.  A rank holds only its own blocks'
    parameters (the others stay on the meta device, never touched) and KV cache (the cache
    allocates a layer when it is first updated).  The last rank streams its ``streamed``
    blocks from the tier (NOTE [inference placement]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshlm.core.annotate import outer_blocks
from meshlm.core.errors import ConfigError
from meshlm.runtime import hooks

_ATTR = "_meshlm_stage"


class Stages:
    """This rank's part of a placement over ``dist``'s world (one device per rank)."""

    def __init__(self, model: nn.Module, pl: Any, rank: int):
        self.rank, self.pl = rank, pl
        self.last_of = {d: pl.runs(d)[-1:] for d in range(pl.devices)}
        self.broadcasts = 0
        for i, blk in enumerate(outer_blocks(model)):
            hooks.set_attrs(blk, hooks.STAGES, **{_ATTR: (self, i)})
            hooks.swap_class(blk, hooks.STAGES, hooks.derived_class(type(blk), "Staged", {"__call__": _staged_call}))

    def call(self, blk: nn.Module, i: int, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"placement over several devices: block {i} ({type(blk).__name__}) takes no hidden-state tensor "
                "as its first argument; the stages hand each block's input on (NOTE [staged decoding])"
            )
        owner = self.pl.owner(i)
        out = super(type(blk), blk).__call__(*args, **kwargs) if owner == self.rank else x
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise ConfigError(
                f"placement over several devices: block {i} ({type(blk).__name__}) returns no tensor of its "
                "input's shape, which the other stages stand in for (NOTE [staged decoding])"
            )
        if i in self.last_of[owner]:
            out = out.contiguous() if owner == self.rank else torch.empty_like(x)
            dist.broadcast(out, src=owner)
            self.broadcasts += 1
        return out


def _staged_call(self, *args, **kwargs):
    st, i = self.__dict__[_ATTR]
    return st.call(self, i, args, kwargs)
