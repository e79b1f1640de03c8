"""What a bucket is: its members' placements and shapes, fixed at lowering time (NOTE
[block buckets] in meshlm/runtime/bucket/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard


@dataclass(frozen=True)
class Member:
    """One parameter of a bucket: its placements, shapes and which data axes move it."""

    storage: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    grads: Optional[tuple[Placement, ...]]  # None: left Partial (ZeRO-1)
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]
    dtype: torch.dtype
    gather: tuple[tuple[int, int], ...]  # (mesh dim, tensor dim), inner mesh dim first


@dataclass(frozen=True)
class Bucket:
    """Everything a block's gather and reduce need, fixed at lowering time."""

    mesh: DeviceMesh
    groups: tuple[str, ...]  # process-group name per mesh dim
    sizes: tuple[int, ...]
    data_dims: tuple[int, ...]  # mesh dims that are data axes, outer -> inner
    members: tuple[Member, ...]
    compute_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    local: bool  # NOTE [local blocks]: may run on plain local tensors
    overlap: bool = False  # NOTE [overlapped reduction]
    grad_dtype: Optional[torch.dtype] = None  # NOTE [main grads] in main_grad.py: where it differs from a member's


# Buckets are referred to by index from traced code (an int is a constant to torch.compile).
# A process-wide table, not per-model state: a Bucket is an immutable value interned by
# content (``register``), so that every layer of a block class, and equal models on the same
# ranks, share one index and one compiled graph.  It holds no tensor and nothing that
# changes; what changes per model (the blocks' order, prefetches in flight, counters) lives
# on the model's ShardState (``Prefetch``).
BUCKETS: list[Bucket] = []


def register(bucket: Bucket) -> int:
    """The index of ``bucket``; equal buckets (every layer of a block class) share one, so
    that a compiled block graph does not specialise on the layer.  Equal meshes (another
    model on the same ranks) share one too: DTensor's sharding-propagation cache already
    hands one model's DTensors the mesh object of another model's equal mesh, and a bucket
    on a third object would make compiled blocks see two meshes and compile twice."""
    for k, b in enumerate(BUCKETS):
        if b == bucket:
            return k
    BUCKETS.append(bucket)
    return len(BUCKETS) - 1


def clear_registry() -> None:
    """Forget every bucket.  Only for when no lowered model is alive and nothing compiled
    refers to an index (``torch._dynamo.reset()`` first): the test harness between modules,
    where the buckets' meshes would otherwise keep every process group they made alive."""
    BUCKETS.clear()


def member(
    storage: Sequence[Placement],
    compute: Sequence[Placement],
    grads: Optional[Sequence[Placement]],
    shape: Sequence[int],
    dtype: torch.dtype,
    data_dims: Sequence[int],
) -> Optional[Member]:
    """The bucket member for one parameter, or None if its storage -> compute move is not a
    pure gather over data axes (then the per-parameter path handles it)."""
    gather = []
    for i, (s, c) in enumerate(zip(storage, compute)):
        if s == c:
            continue
        if i in data_dims and isinstance(s, Shard) and isinstance(c, Replicate):
            gather.append((i, s.dim))
            continue
        return None
    stride = tuple(torch.empty(tuple(shape), device="meta").stride())
    return Member(
        tuple(storage),
        tuple(compute),
        None if grads is None else tuple(grads),
        tuple(shape),
        stride,
        dtype,
        tuple(sorted(gather, key=lambda t: -t[0])),
    )


def grad_target(m: Member, pls: list) -> tuple[Placement, ...]:
    """Where a gradient ends: the layout's ``grads``, or for local grads (ZeRO-1) Partial
    where it is Partial and the storage placement elsewhere."""
    if m.grads is not None:
        return m.grads
    return tuple(pl if pl.is_partial() else sp for pl, sp in zip(pls, m.storage))


# > 0 while a bucket or an at-use parameter gathers (the re-gathering checkpoint policy,
# meshlm/runtime/lowering/policies.py, recomputes the ops run meanwhile).  A dynamic scope, not
# per-model state: it says what the code running now is doing, whichever model it is.
GATHERING = [0]
