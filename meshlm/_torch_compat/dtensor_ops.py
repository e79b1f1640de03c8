"""Adapter: the DTensor rules meshlm adds to torch, installed in one place (private torch APIs).

NOTE [private torch]
    Everything here leans on DTensor internals (``_op_dispatcher._custom_op_handlers``,
    ``DTensorSpec``, the loss-parallel handlers).  A torch upgrade should touch only this
    file, the rules it installs (the other ``dtensor_*.py`` files of this package) and
    ``meshlm/layout/mesh.py:init_fake``.

This module installs the rules and holds the DTensor dispatcher settings a sharded forward
needs (implicit replication, waiting for a redistribute in flight).  What it adds (installed
once, on the first ``shard``), each rule in a file of its own:

* CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward) has no sharding rule in torch 2.11-2.13: heads (dim 1) or batch (dim 0)
  sharded in, the same out, or all replicated (meshlm/_torch_compat/dtensor_sdpa.py).
* ``F.cross_entropy`` on logits sharded over the class dim: torch's loss-parallel handlers
  (``loss_parallel()``), made permanent, and falling back to the default rule when the class
  dim is not sharded; on meshes of several dims where torch's handlers take one dim only
  (2.11), run on the class dim's submesh (NOTE [loss on the class submesh]).  So a
  vocab-sharded loss never all-gathers the logits, and backward need not run inside a
  context manager (meshlm/_torch_compat/dtensor_loss.py).
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
* ``bool(x)``, ``x.item()`` of a Partial or sharded DTensor: the global value, not the local
  part DTensor reads, so a data-dependent branch takes one path on every rank (NOTE [global
  scalars] in meshlm/_torch_compat/dtensor_scalar.py).
"""

from __future__ import annotations

import threading

from torch.distributed.tensor import DTensor

from meshlm._torch_compat import dtensor_views
from meshlm._torch_compat.dtensor_base import aten
from meshlm._torch_compat.dtensor_base import wrap as wrap
from meshlm._torch_compat.dtensor_embedding import _embedding_backward_handler, _embedding_handler
from meshlm._torch_compat.dtensor_loss import (
    _MEAN_LOSS_BACKWARD,
    _class_sharded_or_default,
    _handles_nd_meshes,
    _mean_loss_backward_handler,
    _on_class_submesh,
)
from meshlm._torch_compat.dtensor_scalar import local_scalar_handler
from meshlm._torch_compat.dtensor_sdpa import _register_sdpa_cpu

# ``wrap`` is re-exported: the lowering, the buckets and main_grad build DTensors through
# ``dtensor_ops.wrap``; tests/dist/test_parity.py reaches the loss rules through this module.

_lock = threading.Lock()
_installed = False


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _register_sdpa_cpu()
        handlers = DTensor._op_dispatcher._custom_op_handlers
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
        handlers.update(_MINE)
        _installed = True


_MINE: dict = {}


def ensure_installed() -> None:
    """Put our handlers back if something replaced or removed them: torch's own
    ``loss_parallel()`` context overwrites the loss handlers on entry and deletes them on
    exit (and leaves its own in place when its body raises).  Called at every sharded
    forward; a few dict lookups."""
    install()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, h in _MINE.items():
        if handlers.get(op) is not h:
            handlers[op] = h


def allow_implicit_replication() -> None:
    """Let DTensor treat plain tensors as replicated in this thread, in forward and in every
    later backward (whose thread-local state is captured when ``backward()`` is called).

    NOTE [implicit replication]
        Model code makes plain tensors inside forward (RoPE tables, masks, positions) and
        autograd saves them for backward.  They are identical on every rank, so treating them
        as Replicate is exact.  torch's ``implicit_replication()`` context only covers code
        inside it, and the backward of a loss returned from forward runs after it has been
        left, so a sharded model's forward turns the flag on for its thread and leaves it on.
        Inputs are wrapped as DTensors by the lowering, so rank-local data is never mistaken
        for replicated data; a plain tensor that differs across ranks (``torch.rand`` in
        forward) would be, so draw random numbers from DTensors."""
    DTensor._op_dispatcher._allow_implicit_replication = True


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
