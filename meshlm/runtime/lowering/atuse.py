"""Gather at use: a lowered module's parameter attribute moves the stored DTensor to its
compute placements when read (SimpleFSDP's gather-at-use), through ``AtUse``, whose backward
reduces the gradient to the layout's ``grads`` placements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import Placement, Shard

from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_ops
from meshlm.core.state import RUN, counting, eager
from meshlm.runtime import bucket, main_grad


class AtUse(torch.autograd.Function):
    """NOTE [at-use under compile]: Dynamo traces an autograd.Function's backward ahead of
    time with a gradient that has the forward output's placements (Replicate for a gathered
    weight), while the real gradient of a weight used on a batch-sharded input is Partial.
    Traced that way, the reduction would be dropped.  ``at_use`` hides the Function from
    Dynamo so AOTAutograd traces it on the real placements.

    Forward: stored DTensor -> compute placements (and compute dtype).  Backward: the
    gradient -> ``grads`` placements (Partial becomes all-reduce or reduce-scatter), in the
    reduce dtype; with local grads (ZeRO-1) Partial stays Partial until the optimizer step."""

    @staticmethod
    def forward(ctx, p, compute, grads, dtype, reduce_dtype, regather, grad_dtype=None):  # type: ignore[override]
        ctx.storage = p.placements
        ctx.grads = grads
        ctx.pdtype = p.dtype
        ctx.reduce_dtype = reduce_dtype
        # NOTE [main grads] in main_grad.py: the reduced gradient goes to p.main_grad
        ctx.main = (p, grad_dtype) if grad_dtype is not None and grad_dtype != p.dtype else None
        with counting("gathering", int(regather)):
            x = p if dtype is None or p.dtype == dtype else p.to(dtype)
            if tuple(x.placements) != tuple(compute):
                x = x.redistribute(p.device_mesh, compute)
                if regather:
                    x = dtensor_ops.waited(x)
            return x.view_as(x) if x is p else x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.reduce_dtype is not None and g.dtype != ctx.reduce_dtype:
            g = g.to(ctx.reduce_dtype)
        if ctx.grads is None:  # local: keep Partial, follow storage elsewhere
            target = tuple(gp if gp.is_partial() else sp for gp, sp in zip(g.placements, ctx.storage))
        else:
            target = ctx.grads
        # Reduce-scatter first, then all-reduce what is left, on the scattered shard: HSDP
        # all-reduces 1/fsdp of the gradient over dp, not all of it (DTensor alone would
        # reduce mesh axes in mesh order, dp first).
        first = tuple(t if gp.is_partial() and isinstance(t, Shard) else gp for gp, t in zip(g.placements, target))
        if first != tuple(g.placements) and first != tuple(target):
            g = g.redistribute(g.device_mesh, first)
        # Unconditional: a no-op when the placements already agree at run time.
        g = g.redistribute(g.device_mesh, target)
        if ctx.main is not None:
            main_grad.accumulate(ctx.main[0], g, ctx.main[1])
            return None, None, None, None, None, None, None
        if g.dtype != ctx.pdtype:
            g = g.to(ctx.pdtype)
        return g, None, None, None, None, None, None


# What each at-use parameter does (compute, grads, dtype, reduce_dtype, regather, grad_dtype), by key:
# ``at_use`` takes the key, not the placements, because torch 2.11's Dynamo cannot pass
# Placement objects into an allow_in_graph function ("Missing as_proxy()"); an int it can.
# A process-wide table (NOTE [process-wide tables] in meshlm/runtime/state.py) of immutable
# tuples of placements and dtypes interned by content: equal parameters of every layer and
# every model share a key, so compiled blocks do not specialise on them.
_AT_USE: list[tuple] = []
_AT_USE_KEYS: dict[tuple, int] = {}


def at_use_key(compute, grads, dtype, reduce_dtype, regather, grad_dtype=None) -> int:
    args = (tuple(compute), None if grads is None else tuple(grads), dtype, reduce_dtype, bool(regather), grad_dtype)
    if args not in _AT_USE_KEYS:
        _AT_USE_KEYS[args] = len(_AT_USE)
        _AT_USE.append(args)
    return _AT_USE_KEYS[args]


@compat.allow_in_graph
def at_use(p, key: int):
    """``AtUse`` as one opaque node for Dynamo, so that AOTAutograd (which sees the real
    gradient placements, Partial included) traces its backward; Dynamo would trace it with a
    gradient guessed from the forward output's placements (NOTE [at-use under compile]).
    ``key``: see ``at_use_key``."""
    return AtUse.apply(p, *_AT_USE[key])


@dataclass
class UseSpec:
    compute: tuple[Placement, ...]
    grads: Optional[tuple[Placement, ...]]
    regather: bool = False
    key: int = -1  # at_use_key of these and the model's dtypes
    local_key: Optional[int] = None  # NOTE [local root]: its one-member bucket, gathered at use


def make_getter(name: str):
    def get(self):
        now = self._meshlm_now
        if name in now:  # gathered by the enclosing block's bucket
            return now[name]
        p = self._parameters[name]
        use = self._meshlm_use[name]
        kept = self._meshlm_state.gathered if eager() else None  # NOTE [gathered once per step]
        local_root = RUN.local_root > 0  # NOTE [local root]
        if kept is not None and (id(self), name, local_root) in kept:
            return kept[(id(self), name, local_root)]
        if local_root and use.local_key is not None:
            x = bucket.gather(use.local_key, True, p)[0]
        else:
            x = at_use(p, use.key)
        if kept is not None:
            kept[(id(self), name, local_root)] = x
        return x

    return property(get)


def tied_getter(name: str):
    def get(self):
        first, first_name = self._meshlm_tied[name]
        return getattr(first, first_name)

    return property(get)
