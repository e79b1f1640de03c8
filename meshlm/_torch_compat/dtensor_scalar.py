"""The rule for reading a Python number from a DTensor (part of the adapter in
``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE [private torch]
there).

NOTE [global scalars]
    ``bool(x)``, ``x.item()``, ``float(x)`` and ``int(x)`` on a DTensor reach
    ``aten._local_scalar_dense``, which DTensor (torch 2.11-2.13) runs on the local tensor
    as it is: of a Partial value (``mask.any()``, ``x.sum()`` of a batch-sharded tensor) each
    rank reads its own part, not the value.  A model's data-dependent branch (``if
    gate.any():``, a mixture-of-experts layer that skips an expert no token chose) then takes
    different paths on different ranks of one DTensor program, whose collectives no longer
    match: a hang or a gloo size mismatch, where one device would have taken the branch.
    Ours makes the scalar whole first (``full_tensor``: an all-reduce of a Partial, a
    gather of a shard), so every rank reads the one-device number.  A replicated value is
    read as it is, with no communication.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from meshlm._torch_compat.dtensor_base import default as _default


def local_scalar_handler(op_call, args, kwargs):
    x = args[0]
    if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
        return x.full_tensor().item()
    return _default(op_call, args, kwargs)
