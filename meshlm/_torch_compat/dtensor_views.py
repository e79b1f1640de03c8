"""DTensor view rules meshlm adds to torch (part of the adapter in ``meshlm/_torch_compat/dtensor_ops.py``,
installed by its ``install``; NOTE [private torch] there): a view of a local tensor whose
layout differs from the global strides (NOTE [local view]) and the unflatten of a dim sharded
over two mesh dims (NOTE [strided unflatten])."""

from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlm._torch_compat.dtensor_base import aten, wrap
from meshlm._torch_compat.dtensor_base import contiguous_stride as _contiguous_stride
from meshlm._torch_compat.dtensor_base import default as _default

# --------------------------------------------------------------------------- view
# NOTE [local view]
#     A DTensor's strides are those of the global tensor, computed by sharding propagation
#     on the global shape, while its local tensor has whatever layout its local kernel or
#     the last redistribute gave it, and the two can disagree: a redistribute keeps the
#     global strides but returns the gathered (all-gather), reduced (all-reduce) or split
#     local tensor contiguous.  In Llama's Attention q, k, v are
#     ``F.linear(...).unflatten(-1, (heads, head_dim)).transpose(1, 2)``, global strides of
#     the (batch, seq, heads, head_dim) layout, and ``constrain`` redistributes them (and,
#     in backward, their gradients) whenever compute shards them differently from the
#     projection or from SDPA (heads sharded but not kv_heads or the reverse, embed or
#     head_dim sharded): the local tensor comes back contiguous in (batch, heads, seq,
#     head_dim), and the mismatch carries on through RoPE and SDPA.  The transpose back
#     (``o.transpose(1, 2)`` in forward, the backward of ``.transpose(1, 2)`` in backward)
#     is then contiguous globally and not locally, so the composite ``reshape`` (in
#     ``flatten``, in autograd's backward of ``unflatten``) decides from the global strides
#     that a view suffices and DTensor's local ``aten.view`` raises "view size is not
#     compatible with input tensor's size and stride".  DTensor's view rule looks at shapes
#     and placements, never at strides.  Found by tests/dist/test_layout_properties.py
#     (torch 2.13; its minimal repros there and tests/dist/test_dtensor_rules.py).
#
#     The fix: before ``aten.view`` / ``aten._unsafe_view`` on a DTensor whose local tensor
#     is not contiguous, work out (sharding propagation only, no collective) the local
#     shape DTensor will view it to; if the local tensor cannot be viewed so, view a
#     contiguous copy instead, as ``reshape`` does.  The placements and global shape are
#     DTensor's own and the values the same, so forward and gradients are exact.  What is
#     lost is aliasing: an in-place write through such a result does not reach its base
#     (where torch raised before).  A contiguous local tensor (the common case) goes
#     straight to DTensor's path; the handler costs about 10-20 us per eager view on CPU
#     (of about 70 for the view), nothing in compiled graphs.  Every rank decides alone,
#     and the choice changes no collective: a view that needs a redistribute gets one
#     either way.
#
# NOTE [strided unflatten]
#     Llama's loss flattens (batch, seq, vocab) logits to (batch * seq, vocab); with seq
#     sharded over two mesh axes (``compute: {seq: [dp, tp]}`` or ``[dp, fsdp]``) DTensor
#     gives ``(_StridedShard(0, sf=batch), _StridedShard(0, sf=batch))``, which is right
#     (the rank of seq block k holds rows b * seq + block k, for every b), but its view rule
#     cannot unflatten that back (torch 2.13: "Cannot unflatten tensor with _StridedShard
#     placement" from ``_ViewShardingPropagator._rewrite_strided_shard``, or "would remove
#     or reshape sharded dimension" for a batch the mesh does not divide), and the backward
#     of the flatten is that unflatten, so backward raised.  Found by
#     tests/dist/test_layout_properties.py (seq over [dp, tp] and [dp, fsdp] on 2x2 meshes).
#
#     The fix, only where DTensor's own rule raises for a view of a tensor with a
#     _StridedShard placement: find output placements (each sharded mesh dim a plain Shard
#     of some output dim, the other mesh dims as they are) whose view back to the input's
#     shape DTensor propagates, with no redistribute, to exactly the input's placements.
#     DTensor's flatten is a local view, so the input's local tensor is the found
#     placements' local tensor flattened, and the result is a view of it at their local
#     shape (any two placements that fit hold the same local data).  Sharding propagation
#     only (cached per mesh, placements, shapes), no collective, a view still; if nothing
#     fits, DTensor's own error.
VIEW_OPS = (aten.view.default, aten._unsafe_view.default)


def view_handler(op_call, args, kwargs):
    x = args[0]
    if not isinstance(x, DTensor) or kwargs:
        return _default(op_call, args, kwargs)
    if any(isinstance(p, _StridedShard) for p in x.placements):
        out = _strided_view(op_call, x, args[1])
        if out is not None:
            return out
    if not x._local_tensor.is_contiguous() and not _local_view_ok(op_call, x, args[1]):
        x = DTensor(x._local_tensor.contiguous(), x._spec, requires_grad=False)
        args = (x, *args[1:])
    return _default(op_call, args, kwargs)


def _view_sharding(op_call, spec, shape):
    """DTensor's sharding propagation of ``op_call(tensor of spec, shape)``; no collective."""
    from torch.distributed.tensor._op_schema import OpSchema

    prop = DTensor._op_dispatcher.sharding_propagator
    schema = OpSchema(op_call, (spec, list(shape)), {}, schema_info=prop.op_to_schema_info.get(op_call))
    return prop.propagate_op_sharding(schema)


def _try_view_sharding(op_call, spec, shape):
    """``_view_sharding``, or None where DTensor's rule raises."""
    try:
        return _view_sharding(op_call, spec, shape)
    except (RuntimeError, AssertionError, NotImplementedError, ValueError):
        return None


def _keeps_input(sharding, spec) -> bool:
    """Whether DTensor runs the op on the input as it is (no redistribute first)."""
    rs = sharding.redistribute_schema
    return rs is None or tuple(rs.args_spec[0].placements) == tuple(spec.placements)


def _local_view_ok(op_call, x: DTensor, shape) -> bool:
    """Whether DTensor's local ``op_call`` on ``x``'s local tensor can be a view."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = _try_view_sharding(op_call, x._spec, shape)
    if out is None:
        return True  # DTensor's own path raises its own error
    if not _keeps_input(out, x._spec):
        return True  # the view is of a fresh (redistributed) tensor, not of this one
    spec = out.output_spec
    local_shape, _ = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements, skip_offset=True)
    try:
        x._local_tensor.view(local_shape)
    except (RuntimeError, ValueError):  # a fake tensor's view raises ValueError (meshlm.plan measures on them)
        return False
    return True


def _strided_view(op_call, x: DTensor, shape):
    """NOTE [strided unflatten]: the view of ``x`` where DTensor's rule raises for its
    _StridedShard placements; None where DTensor's rule works or nothing fits."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    try:
        out = meta.view(shape) if op_call == aten.view.default else meta.reshape(shape)
    except RuntimeError:
        return None  # not a view of the global tensor: DTensor's own error
    key = (op_call, x.device_mesh, tuple(x.placements), tuple(x.shape), tuple(out.shape), x.dtype)
    ints = all(type(d) is int for d in key[3] + key[4])  # symbolic sizes (compile) are not cached
    placements = (_strided_view_placements if ints else _strided_view_placements.__wrapped__)(*key)
    if placements is None:
        return None
    mesh = x.device_mesh
    local_shape, _ = compute_local_shape_and_global_offset(out.shape, mesh, placements, skip_offset=True)
    local = x._local_tensor
    local = local.view(local_shape) if _viewable(local, local_shape) else local.reshape(local_shape)
    return wrap(local, mesh, placements, tuple(out.shape), out.stride())


def _viewable(t: Tensor, shape) -> bool:
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _strided_view_placements(op_call, mesh, placements, in_shape, out_shape, dtype):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    def spec(pls, shape):
        return DTensorSpec(
            mesh, tuple(pls), tensor_meta=TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype)
        )

    own = _try_view_sharding(op_call, spec(placements, in_shape), out_shape)
    if own is not None and _keeps_input(own, spec(placements, in_shape)):
        return None  # DTensor's own rule handles it
    sharded = [i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))]
    for dims in itertools.product(range(len(out_shape)), repeat=len(sharded)):
        pls = list(placements)
        for i, d in zip(sharded, dims):
            pls[i] = Shard(d)
        cand = spec(pls, out_shape)
        back = _try_view_sharding(aten.view.default, cand, in_shape)  # None: cannot flatten back
        if back is not None and _keeps_input(back, cand) and tuple(back.output_spec.placements) == placements:
            return tuple(pls)
    return None
