"""DTensor's strategy costs for strided shards on meshes of two or more dims, on meshlm's
meshes (private torch API: ``_ops.utils.redistribute_cost``; NOTE [private torch] in
dtensor_ops.py).

NOTE [strided costs]
    To pick an op's sharding strategy, DTensor prices every candidate input placement by
    the redistribute that would reach it (``redistribute_cost``).  Where either side holds a
    ``_StridedShard`` (a flattened (batch, sequence) split over the batch axes and cp, the
    rows of every projection under ``seq: cp``), torch 2.13 always prices it with its
    min-cost path search over the mesh's placement states (``find_min_cost_path``), which
    grows with the number of mesh dims: on fsdp=2 x tp=2 x cp=2 one rank's first forward and
    backward of llama_tiny ran past five minutes, almost all of it in that search (thousands
    of candidates, each a search of hundreds of states); on fsdp=2 x cp=2 it was 23 s of a
    43 s two-step parity check (cProfile, one rank).  On meshlm's meshes of two or more dims
    such a candidate is priced as the sum of its per-dim moves (torch's own one-dim cost,
    ``_compute_placement_transition_cost``), as torch prices placements without strided
    shards: the same check then took 9 s, with the same losses and gradients.  The
    collectives of a GPT-2 step stayed the same on fsdp=2 x cp=2 (and of an einsum-attention
    model on fsdp=2 x tp=2); on tp=2 x cp=2 the cheaper-looking strategy adds two
    reduce-scatters over tp in backward (32 KiB for that GPT-2), which the planner counts as
    it runs the same pricing.
    It only ranks candidates, so the result is the same tensor whichever wins, and the
    redistribute that runs is still planned by torch.  One-dim meshes, and meshes meshlm did
    not make, keep torch's search (NOTE [scoped patches] in dtensor_scope.py).  Checked by
    tests/dist/test_cp.py's 8-process fsdp_tp_cp parity against one device.
"""

from __future__ import annotations

import threading

from torch.distributed.tensor import _collective_utils as collective
from torch.distributed.tensor._ops import utils as op_utils
from torch.distributed.tensor.placement_types import _StridedShard

from meshlm._torch_compat import dtensor_scope

_lock = threading.Lock()
_STOCK: list = []  # torch's redistribute_cost, once replaced


def _strided(spec) -> bool:
    return any(isinstance(p, _StridedShard) for p in spec.placements)


def redistribute_cost(current, target) -> float:
    """The cost of moving ``current`` to ``target`` (torch's contract for this function)."""
    mesh = current.mesh
    if mesh.ndim < 2 or mesh != target.mesh or not (_strided(current) or _strided(target)):
        return _STOCK[0](current, target)
    if not dtensor_scope.owns(mesh):
        return _STOCK[0](current, target)
    if current.is_replicated() or current.placements == target.placements:
        return 0.0
    topo = collective.MeshTopoInfo.build_from_mesh(mesh)
    gb = collective.spec_to_bytes(current) / current.num_shards / 1024**3
    total = 0.0
    for dim, (src, dst) in enumerate(zip(current.placements, target.placements)):
        cost, gb = collective._compute_placement_transition_cost(src, dst, topo, dim, gb)
        total += cost
    return total


def install() -> None:
    """Replace the function DTensor's strategy builders call; once per process."""
    with _lock:
        if _STOCK:
            return
        _STOCK.append(op_utils.redistribute_cost)
        op_utils.redistribute_cost = redistribute_cost
