"""Blocks on local rows (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py): which inputs
qualify, and their outputs wrapped back as batch-sharded DTensors."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from meshlm.core.errors import AnnotationError


def batch_sharded(x, sizes: Sequence[int]) -> bool:
    """A DTensor split along dim 0 over every mesh dim of size > 1 (NOTE [local blocks])."""
    return (
        isinstance(x, DTensor)
        and x.ndim >= 1
        and len(x.placements) == len(sizes)
        and all(
            (isinstance(p, Shard) and p.dim == 0) if n > 1 else not p.is_partial() for p, n in zip(x.placements, sizes)
        )
    )


def wrap_local(x, mesh: DeviceMesh, sizes: Sequence[int], placements: Sequence[Placement]):
    """An output computed on local rows -> the batch-sharded DTensor it is (placed as the
    input rows, ``placements`` on ``mesh``, whose dim sizes are ``sizes``: plain ints, which
    traced code reads instead of the mesh)."""
    if not isinstance(x, Tensor) or isinstance(x, DTensor):
        return x
    if x.ndim == 0:
        raise AnnotationError(
            "a block returned a 0-d tensor while running on local rows (NOTE [local blocks] in "
            "meshlm/runtime/bucket/__init__.py): blocks must return batch-first activations"
        )
    world = 1
    for s, p in zip(sizes, placements):
        world *= s if isinstance(p, Shard) else 1
    shape = (x.shape[0] * world,) + tuple(x.shape[1:])
    return DTensor.from_local(
        x,
        mesh,
        tuple(placements),
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
