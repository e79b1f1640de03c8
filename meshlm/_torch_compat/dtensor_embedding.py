"""The vocab-parallel ``F.embedding`` rule (part of the adapter in
``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE [private torch]
there).  DTensor's own rule yields a MaskPartial output whose gradient cannot come back
through a Partial(sum).  Ours looks up the local vocab rows with out-of-range ids masked to
zero and returns Partial(sum) (the next ``constrain`` all-reduces or reduce-scatters it), and
its backward returns the vocab shard of the gradient."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm._torch_compat.dtensor_base import contiguous_stride as _contiguous_stride
from meshlm._torch_compat.dtensor_base import default as _default
from meshlm._torch_compat.dtensor_base import wrap


# --------------------------------------------------------------------------- embedding
def _vocab_range(w: DTensor) -> tuple[list[int], int, int]:
    """Mesh dims that shard the vocab (dim 0) of ``w`` and this rank's [lo, hi) rows."""
    mesh = w.device_mesh
    dims = [i for i, p in enumerate(w.placements) if isinstance(p, Shard) and p.dim == 0]
    rows = w._local_tensor.shape[0]
    idx = 0
    for i in dims:  # NOTE [shard order]: outer mesh dims are the outer blocks
        idx = idx * mesh.size(i) + mesh.get_local_rank(i)
    return dims, idx * rows, (idx + 1) * rows


def _embedding_handler(op_call, args, kwargs):
    w, ids = args[0], args[1]
    if not isinstance(w, DTensor):
        return _default(op_call, args, kwargs)
    mesh = w.device_mesh
    if not isinstance(ids, DTensor):  # every rank's ids (a decode step's positions, from its KV cache):
        # replicated explicitly, as DTensor's implicit replication reads numel(), which a
        # compiled decode step's symbolic batch does not have
        ids = DTensor.from_local(ids, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if not any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
        return _default(op_call, (w, ids, *args[2:]), kwargs)
    vdims, lo, hi = _vocab_range(w)
    # ids must be whole on the vocab mesh dims (every rank looks up its rows for every id)
    want = [Replicate() if i in vdims else p for i, p in enumerate(ids.placements)]
    if list(ids.placements) != want:
        ids = ids.redistribute(mesh, want)
    out_pl = []
    for i, (wp, ip) in enumerate(zip(w.placements, ids.placements)):
        if i in vdims:
            out_pl.append(Partial())
        elif isinstance(wp, Shard):  # embed dim sharded
            out_pl.append(Shard(ids.dim()))
        else:
            out_pl.append(ip)
    orig_ids = args[1]
    if isinstance(orig_ids, DTensor):  # NOTE [lookup on the ids]
        lookups = orig_ids.__dict__.setdefault(_LOOKUPS, {})
        lookups[w.shape[0]] = (vdims, lo, hi, w._local_tensor.shape[0], tuple(ids.placements))
    loc_ids = ids._local_tensor
    miss = (loc_ids < lo) | (loc_ids >= hi)
    local = torch.nn.functional.embedding((loc_ids - lo).masked_fill(miss, 0), w._local_tensor)
    local = local.masked_fill(miss.unsqueeze(-1), 0.0)
    shape = tuple(ids.shape) + (w.shape[1],)
    return wrap(local, mesh, out_pl, shape, _contiguous_stride(shape))


def _embedding_backward_handler(op_call, args, kwargs):
    grad, ids = args[0], args[1]
    lookups = getattr(ids, _LOOKUPS, None) if isinstance(ids, DTensor) else None
    ctx = lookups.get(args[2]) if lookups else None  # args[2]: the table's rows (num_weights)
    if ctx is None:
        return _default(op_call, args, kwargs)
    vdims, lo, hi, rows, id_pl = ctx
    mesh = grad.device_mesh
    # Every rank needs the whole gradient of the lookups on the vocab mesh dims (it holds
    # the rows for all of them); elsewhere the gradient follows the ids.
    want = [
        Replicate() if i in vdims else (g if g.is_partial() else p)
        for i, (p, g) in enumerate(zip(id_pl, grad.placements))
    ]
    if list(grad.placements) != want:
        grad = grad.redistribute(mesh, want)
    loc_ids = ids._local_tensor if isinstance(ids, DTensor) else ids
    if isinstance(ids, DTensor) and list(ids.placements) != list(id_pl):
        loc_ids = ids.redistribute(mesh, id_pl)._local_tensor
    miss = (loc_ids < lo) | (loc_ids >= hi)
    g = grad._local_tensor.masked_fill(miss.unsqueeze(-1), 0.0)
    local = torch.zeros(rows, g.shape[-1], dtype=g.dtype, device=g.device)
    local.index_add_(0, (loc_ids - lo).masked_fill(miss, 0).reshape(-1), g.reshape(-1, g.shape[-1]))
    out_pl = []
    for i, p in enumerate(id_pl):
        if i in vdims:
            out_pl.append(Shard(0))
        elif isinstance(p, Shard) or isinstance(grad.placements[i], Partial):
            out_pl.append(Partial())  # ranks saw different ids: their row gradients add up
        else:
            out_pl.append(Replicate())
    shape = (args[2], g.shape[-1])
    return wrap(local, mesh, out_pl, shape, _contiguous_stride(shape))


# NOTE [lookup on the ids]
#     The backward op (``embedding_dense_backward(grad, ids, num_weights, ...)``) sees the
#     ids autograd saved, not the weight, so the forward leaves what the backward needs
#     (vocab mesh dims, this rank's [lo, hi) rows, its local rows, the ids' placements in
#     forward) on the ids DTensor itself, per table size: it lives and dies with the ids
#     (autograd's saved ids are the same Python object) and no model sees another's.
_LOOKUPS = "_meshlm_vocab_lookups"
