"""A function of each batch row on its own, run on this rank's rows as local tensors.

NOTE [rowwise]
    ``rowwise(fn, *args)`` is ``fn(*args)`` for an ``fn`` that computes each batch row from
    that row alone (its tensor arguments batch-first, or weights shared by every row) and
    returns batch-first tensors with as many rows.  The MoE layer's routing, its dispatch
    into the experts' buffer and its combine back are such functions (NOTE [moe routing] in
    meshlm/core/moe.py), a few dozen small ops each, and under a layout every one of them
    pays DTensor's per-op dispatch, in forward and in backward.  When the DTensor arguments
    are split over each mesh dim by rows (``Shard(0)``) or not at all (``Replicate``), every
    row split alike, each rank has all it needs for its own rows, so ``fn`` runs once on the
    local tensors: a row-split argument enters through ``to_local`` as it is, a whole one
    (a weight) with its gradient partial over the row-split mesh dims (each rank's rows'
    share, which the parameter's reduction sums), and every output leaves through
    ``from_local`` split by rows as the inputs, with the global row count.  The same math on
    the same local tensors as DTensor's ops.  Otherwise (another split, a partial argument,
    several meshes, plain tensors, torch.compile) ``fn`` runs on the arguments as given.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm._torch_compat.dtensor_base import wrap

__all__ = ["rowwise"]


def rowwise(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on this rank's rows as local tensors where the arguments allow it
    (NOTE [rowwise]); ``fn`` returns a tensor or a tuple of batch-first tensors."""
    rows = _row_placements(args)
    if rows is None:
        return fn(*args)
    pl, nrows = rows
    split = [isinstance(p, Shard) for p in pl]
    local = []
    for a in args:
        if not isinstance(a, DTensor):
            local.append(a)
        elif any(isinstance(p, Shard) for p in a.placements):
            local.append(a.to_local())
        else:
            local.append(a.to_local(grad_placements=[Partial() if s else p for s, p in zip(split, a.placements)]))
    out = fn(*local)
    mesh = next(a for a in args if isinstance(a, DTensor)).device_mesh

    def lift(t: Tensor) -> DTensor:
        return wrap(t, mesh, pl, (t.shape[0] if nrows is None else nrows, *t.shape[1:]))

    return tuple(lift(t) for t in out) if isinstance(out, tuple) else lift(out)


def _row_placements(args) -> Optional[tuple[tuple, Optional[int]]]:
    """(the row-split arguments' placements, their global row count: None where nothing is
    split) if ``fn`` may run on local rows (NOTE [rowwise]), else None."""
    ds = [a for a in args if isinstance(a, DTensor)]
    if not ds or len(ds) != sum(isinstance(a, Tensor) for a in args) or torch.compiler.is_compiling():
        return None
    mesh = ds[0].device_mesh
    rows, nrows = None, None
    for d in ds:
        if d.device_mesh != mesh or not all(p == Shard(0) or isinstance(p, Replicate) for p in d.placements):
            return None
        if any(isinstance(p, Shard) for p in d.placements):
            if rows is not None and (tuple(d.placements), d.shape[0]) != (rows, nrows):
                return None
            rows, nrows = tuple(d.placements), d.shape[0]
    if rows is None:  # every argument whole: the rows too
        return tuple(Replicate() for _ in range(mesh.ndim)), None
    return rows, nrows
