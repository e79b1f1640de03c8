"""Adapter: the DTensor rules meshlm adds to torch, installed in one place (private torch APIs).

NOTE [private torch]
    Everything here leans on DTensor internals (``_op_dispatcher._custom_op_handlers``,
    ``DTensorSpec``, the loss-parallel handlers).  A torch upgrade should touch only this
    file, the rules it installs (the other ``dtensor_*.py`` files of this package) and
    ``meshlm/layout/mesh.py:init_fake``.

This module installs the rules and holds the DTensor dispatcher settings a sharded forward
needs (implicit replication, waiting for a redistribute in flight).  Every rule acts on
DTensors on meshlm's meshes only (those ``make_mesh`` built or ``shard`` sharded onto); any
other DTensor in the process gets exactly what torch gives it (NOTE [scoped patches] in
meshlm/_torch_compat/dtensor_scope.py).  What it adds (installed once, on the first
``shard``), each rule in a file of its own:

* CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward) has no sharding rule in torch 2.11-2.13: heads (dim 1) or batch (dim 0)
  sharded in, the same out, or all replicated (meshlm/_torch_compat/dtensor_sdpa.py).
* ``F.cross_entropy`` on logits sharded over the class dim: torch's loss-parallel handlers
  (``loss_parallel()``), always on for meshlm's meshes, and falling back to the default
  rule when the class dim is not sharded; on meshes of several dims where torch's handlers
  take one dim only (2.11), run on the class dim's submesh (NOTE [loss on the class
  submesh]).  So a vocab-sharded loss never all-gathers the logits, and backward need not
  run inside a context manager (meshlm/_torch_compat/dtensor_loss.py).
* Vocab-parallel ``F.embedding``: DTensor's own rule yields a MaskPartial output whose
  gradient cannot come back through a Partial(sum).  Ours looks up the local
  vocab rows with out-of-range ids masked to zero and returns Partial(sum) (the next
  ``constrain`` all-reduces or reduce-scatters it), and its backward returns the vocab
  shard of the gradient (meshlm/_torch_compat/dtensor_embedding.py).
* The backward of a mean-reduced elementwise loss (``F.mse_loss``, ``F.smooth_l1_loss``,
  ``F.huber_loss``, ``F.binary_cross_entropy``, ``F.soft_margin_loss``) on a sharded input:
  DTensor runs torch's kernel on each shard, which divides by the shard's element count,
  not the tensor's, so in torch 2.11-2.13 the gradient comes out (number of shards) times
  too large while the loss is right (NOTE [mean loss backward] in
  meshlm/_torch_compat/dtensor_loss.py).
* ``aten.view`` / ``aten._unsafe_view`` where the local tensor's layout differs from the
  global strides DTensor decided the view on (after a redistribute, the local tensor is
  contiguous and the global strides are not): a view of a contiguous copy where the local
  view is impossible, instead of "view size is not compatible" (NOTE [local view]); and the
  unflatten of a dim DTensor flattened into two _StridedShards (seq sharded over two mesh
  axes, flattened for the loss), which DTensor's view rule cannot undo in torch 2.13
  (NOTE [strided unflatten]); both in meshlm/_torch_compat/dtensor_views.py.
* ``Shard(i) -> Shard(j)`` on one mesh dim of a CPU mesh: one gloo all-to-all, not torch's
  all-gather and chunk (NOTE [cpu all-to-all] in meshlm/_torch_compat/dtensor_alltoall.py).
* ``bool(x)``, ``x.item()`` of a Partial or sharded DTensor: the global value, not the local
  part DTensor reads, so a data-dependent branch takes one path on every rank (NOTE [global
  scalars] in meshlm/_torch_compat/dtensor_scalar.py).
* The price of a candidate strategy whose input holds a ``_StridedShard`` on a mesh of three
  or more dims: the sum of its per-dim moves, not torch's path search over the mesh's
  states, which took minutes per rank on fsdp x tp x cp (NOTE [strided costs] in
  meshlm/_torch_compat/dtensor_costs.py).
"""

from __future__ import annotations

import threading

from torch.distributed.tensor import DTensor

from meshlm._torch_compat import dtensor_alltoall, dtensor_costs, dtensor_replication, dtensor_scope, dtensor_views
from meshlm._torch_compat.dtensor_base import aten
from meshlm._torch_compat.dtensor_base import default as _default
from meshlm._torch_compat.dtensor_base import wrap as wrap
from meshlm._torch_compat.dtensor_cp import cp_sdpa_rules
from meshlm._torch_compat.dtensor_embedding import _embedding_backward_handler, _embedding_handler
from meshlm._torch_compat.dtensor_loss import (
    _MEAN_LOSS_BACKWARD,
    _class_sharded_or_default,
    _handles_nd_meshes,
    _mean_loss_backward_handler,
    _on_class_submesh,
)
from meshlm._torch_compat.dtensor_scalar import local_scalar_handler
from meshlm._torch_compat.dtensor_sdpa import sdpa_cpu_rules

# ``wrap`` is re-exported: the lowering, the buckets and main_grad build DTensors through
# ``dtensor_ops.wrap``; tests/dist/test_parity.py reaches the loss rules through this module.

_lock = threading.Lock()
_installed = False

# op -> meshlm's rule for it, looked up at every call (a test swaps entries for torch 2.11's loss path)
_MINE: dict = {}
# op -> the handler stock torch has for it now, under ours: torch's loss-parallel handlers
# while a ``loss_parallel()`` block is open (its handlers go here, not over ours)
_BELOW: dict = {}


def _dispatch(op_call, args, kwargs):
    """The one handler meshlm puts in DTensor's dispatcher for each op it has a rule for:
    meshlm's rule on meshlm's meshes, what torch would run anywhere else (NOTE [scoped
    patches] in dtensor_scope.py)."""
    if dtensor_scope.owned(args, kwargs):
        return _MINE[op_call](op_call, args, kwargs)
    below = _BELOW.get(op_call)
    if below is not None:
        return below(op_call, args, kwargs)
    return _default(op_call, args, kwargs)


def install() -> None:
    """Put meshlm's DTensor rules in place, scoped to meshlm's meshes; once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        from torch.distributed.tensor.parallel import loss as _loss

        nd = _handles_nd_meshes(_loss)
        for op, torch_handler in _loss.customized_loss_ops.items():
            _MINE[op] = _class_sharded_or_default(op, torch_handler if nd else _on_class_submesh(torch_handler))
        _MINE[aten.embedding.default] = _embedding_handler
        _MINE[aten.embedding_dense_backward.default] = _embedding_backward_handler
        for op in _MEAN_LOSS_BACKWARD:
            _MINE[op] = _mean_loss_backward_handler
        for op in dtensor_views.VIEW_OPS:
            _MINE[op] = dtensor_views.view_handler
        _MINE[aten._local_scalar_dense.default] = local_scalar_handler
        _MINE.update(cp_sdpa_rules(sdpa_cpu_rules()))

        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op in _MINE:
            prev = handlers.get(op)
            if prev is not None and prev is not _dispatch:
                _BELOW[op] = prev  # installed inside a loss_parallel() block: its handler stays under ours
            handlers[op] = _dispatch
        _layer_loss_parallel(_loss)
        dtensor_replication.install()
        dtensor_alltoall.install()
        dtensor_costs.install()
        _installed = True


def _layer_loss_parallel(loss_module) -> None:
    """Make torch's ``loss_parallel()`` put its handlers under ours and take them from there.

    ``loss_parallel()`` writes its handlers into DTensor's dispatcher on entry and deletes
    those entries on exit (not restoring what was there), through two module functions it
    looks up at each call.  In their place: where our handler holds an op, torch's goes to
    ``_BELOW`` (so the block runs torch's handlers on every other mesh, as without meshlm)
    and leaves it on exit (a KeyError where torch's own delete would raise one); ours stay.
    A torch without the two functions would overwrite and delete our loss entries: meshlm's
    losses then take DTensor's default rules (the same values, the logits gathered)."""
    enable = getattr(loss_module, "_enable_custom_loss_ops", None)
    disable = getattr(loss_module, "_disable_custom_loss_ops", None)
    if enable is None or disable is None or getattr(enable, "meshlm_layered", False):
        return

    def enable_under_meshlm():
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op, handler in loss_module.customized_loss_ops.items():
            if handlers.get(op) is _dispatch:
                _BELOW[op] = handler
            else:
                handlers[op] = handler

    def disable_under_meshlm():
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op in loss_module.customized_loss_ops:
            if handlers.get(op) is _dispatch:
                _BELOW.pop(op)
            else:
                handlers.pop(op)

    enable_under_meshlm.meshlm_layered = True
    loss_module._enable_custom_loss_ops = enable_under_meshlm
    loss_module._disable_custom_loss_ops = disable_under_meshlm


def claim_mesh(mesh) -> None:
    """Make ``mesh`` meshlm's: its DTensors get meshlm's rules (NOTE [scoped patches])."""
    dtensor_scope.claim(mesh)


def allow_implicit_replication() -> None:
    """Let DTensor treat plain tensors as replicated on meshlm's meshes in this thread, in
    forward and in every later backward (NOTE [implicit replication] in
    dtensor_replication.py; other meshes keep torch's own setting)."""
    dtensor_replication.hold()


def waited(x: DTensor) -> DTensor:
    """``x`` with its local tensor's pending collective (if any) waited for now.

    DTensor's redistribute returns an AsyncCollectiveTensor that waits at its first use.
    The re-gather policy (NOTE [re-gather in backward]) must see the wait as part of the
    gather, or activation checkpointing caches the waited (gathered) tensor."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = x._local_tensor
    if isinstance(local, AsyncCollectiveTensor):
        return DTensor.from_local(
            local.wait(), x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
    return x
