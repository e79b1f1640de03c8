"""What a bucket is: its members' placements and shapes, fixed at lowering time (NOTE
[block buckets] in meshlm/runtime/bucket/__init__.py)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
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


# Buckets are referred to by index from traced code (an int is a constant to torch.compile):
# a process-wide table (NOTE [process-wide tables] in meshlm/runtime/state.py), a plain list
# so that traced code reads it as it reads any global.  A Bucket is an immutable value
# interned by content (``register``), so that every layer of a block class, and equal models
# on the same ranks, share one index and one compiled graph; what changes per model (the
# blocks' order, prefetches in flight, counters) lives on the model's ShardState
# (``Prefetch``).  A slot holds its bucket while a model that registered it lives, and None
# after: the bucket's mesh (and its process groups) go with the last such model, while the
# index stays reserved for an equal bucket, which takes the same slot again.
BUCKETS: list[Optional[Bucket]] = []
_OWNERS: list[int] = []  # per slot: how many live models registered it
_FREE: dict[tuple, list[int]] = {}  # identity (nothing of a model) -> empty slots it may take again
_BY_OWNER: dict[int, tuple[weakref.finalize, set[int]]] = {}  # id(owner) -> (its finalizer, the slots it holds)


def identity(b: Bucket) -> tuple:
    """What a bucket is without its mesh object: the mesh's device type and dim names in its
    place (its process groups, hence its ranks, are named by ``groups``, its sizes by
    ``sizes``).  No tensor op: the planner registers buckets under a fake tensor mode."""
    mesh = (b.mesh.device_type, b.mesh.mesh_dim_names)
    return (mesh, *(getattr(b, f.name) for f in fields(b) if f.name != "mesh"))


def register(bucket: Bucket, owner: object) -> int:
    """The index of ``bucket``, held while ``owner`` (the model's ShardState) lives; equal
    buckets (every layer of a block class) share one, so that a compiled block graph does
    not specialise on the layer.  Equal meshes (another model on the same ranks) share one
    too: DTensor's sharding-propagation cache already hands one model's DTensors the mesh
    object of another model's equal mesh, and a bucket on a third object would make
    compiled blocks see two meshes and compile twice."""
    k = next((k for k, b in enumerate(BUCKETS) if b is not None and b == bucket), None)
    if k is None:
        free = _FREE.get(identity(bucket))
        if free:
            k = free.pop()
            BUCKETS[k] = bucket
        else:
            BUCKETS.append(bucket)
            _OWNERS.append(0)
            k = len(BUCKETS) - 1
    held = _BY_OWNER.get(id(owner))
    if held is None:
        held = _BY_OWNER[id(owner)] = (weakref.finalize(owner, _release, id(owner)), set())
    if k not in held[1]:
        held[1].add(k)
        _OWNERS[k] += 1
    return k


def _release(owner_id: int) -> None:
    """``owner`` was collected: empty the slots no live model holds any more."""
    _fin, slots = _BY_OWNER.pop(owner_id, (None, ()))
    for k in slots:
        _OWNERS[k] -= 1
        b = BUCKETS[k]
        if _OWNERS[k] == 0 and b is not None:
            BUCKETS[k] = None
            _FREE.setdefault(identity(b), []).append(k)


def clear_registry() -> None:
    """Forget every bucket.  Only for when no lowered model is alive and nothing compiled
    refers to an index (``torch._dynamo.reset()`` first): the test harness between modules,
    where the buckets' meshes would otherwise keep every process group they made alive."""
    for fin, _slots in _BY_OWNER.values():
        fin.detach()
    BUCKETS.clear()
    _OWNERS.clear()
    _FREE.clear()
    _BY_OWNER.clear()


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
