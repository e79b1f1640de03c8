"""DTensor's shard-to-shard redistribute (``Shard(i) -> Shard(j)`` on one mesh dim) as one
all-to-all on CPU meshes of meshlm (private torch API: ``placement_types.shard_dim_alltoall``).

NOTE [cpu all-to-all]
    Moving a tensor from one sharded dim to another over a mesh dim is an all-to-all: rank
    r sends its j-th chunk along the new dim to rank j and receives rank j's r-th chunk.
    torch 2.11-2.13 run it as ``all_to_all_single`` on GPUs, but on a CPU mesh DTensor
    all-gathers the whole tensor and keeps a chunk ("CPU process group does not support
    alltoall yet"), which moves (N-1) times the bytes.  Gloo has ``all_to_all_single``
    with equal splits, so on meshlm's CPU meshes this rule runs the real all-to-all
    (``torch.ops._c10d_functional.all_to_all_single``, which ``meshlm.runtime.comm``
    counts as an ``all_to_all``).  Expert parallelism's dispatch and return are this move
    (NOTE [moe routing] in meshlm/core/moe.py).  Other meshes, and GPU meshes, keep
    torch's path (NOTE [scoped patches] in dtensor_scope.py).

NOTE [a2a copies]
    The exchange needs its send buffer contiguous with rank j's chunk j-th, and hands back
    rank j's chunk j-th.  Chunking along dim 0 of a contiguous tensor is already that
    layout, and concatenating the received chunks along dim 0 is a view of them: one copy
    fewer on each side than stacking the chunks and concatenating them.  Expert
    parallelism's dispatch gathers along dim 0 (``batch``) and its return chunks along it,
    so each of its all-to-alls, forward and backward, holds three buffers of its share at
    its peak (input, send or result, received), not four.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor
from torch.distributed.tensor import placement_types

from meshlm._torch_compat import dtensor_scope

_lock = threading.Lock()
_STOCK: list = []  # torch's shard_dim_alltoall, once replaced


def shard_dim_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
    """``input``'s chunks along ``shard_dim`` to the ranks of ``mesh_dim``, theirs
    concatenated along ``gather_dim`` (torch's contract for this function)."""
    if mesh.device_type != "cpu" or not dtensor_scope.owns(mesh):
        return _STOCK[0](input, gather_dim, shard_dim, mesh, mesh_dim)
    n = mesh.size(mesh_dim)
    if input.shape[shard_dim] % n:
        send = torch.stack(torch.chunk(input, n, dim=shard_dim))  # raises: equal splits only
    # (n, ...): chunk j for rank j; a view, no copy, when shard_dim is 0 (NOTE [a2a copies])
    send = input.unflatten(shard_dim, (n, -1)).movedim(shard_dim, 0).contiguous()
    got = wait_tensor(all_to_all_single(send, None, None, (mesh, mesh_dim)))
    # rank j's chunk j-th along gather_dim; a view when gather_dim is 0
    return got.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1).contiguous()


def install() -> None:
    """Replace the function DTensor's ``Shard`` placement calls; once per process."""
    with _lock:
        if _STOCK:
            return
        _STOCK.append(placement_types.shard_dim_alltoall)
        placement_types.shard_dim_alltoall = shard_dim_alltoall
