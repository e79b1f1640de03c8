"""Adapter: the DTensor rules meshlm adds to torch, in one place (private torch APIs).

NOTE [private torch]
    Everything here leans on DTensor internals (``_op_dispatcher._custom_op_handlers``,
    ``DTensorSpec``, the loss-parallel handlers).  A torch upgrade should touch only this
    file and ``meshlm/mesh.py:init_fake``.

What it adds (installed once, on the first ``shard``):

* CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward) has no sharding rule in torch 2.11-2.13: heads (dim 1) or batch (dim 0)
  sharded in, the same out, or all replicated.
* ``F.cross_entropy`` on logits sharded over the class dim: torch's loss-parallel handlers
  (``loss_parallel()``), made permanent, and falling back to the default rule when the class
  dim is not sharded; on meshes of several dims where torch's handlers take one dim only
  (2.11), run on the class dim's submesh (NOTE [loss on the class submesh]).  So a
  vocab-sharded loss never all-gathers the logits, and backward need not run inside a
  context manager.
* Vocab-parallel ``F.embedding``: DTensor's own rule yields a MaskPartial output whose
  gradient cannot come back through a Partial(sum).  Ours looks up the local
  vocab rows with out-of-range ids masked to zero and returns Partial(sum) (the next
  ``constrain`` all-reduces or reduce-scatters it), and its backward returns the vocab
  shard of the gradient.
* The backward of a mean-reduced elementwise loss (``F.mse_loss``, ``F.smooth_l1_loss``,
  ``F.huber_loss``, ``F.binary_cross_entropy``, ``F.soft_margin_loss``) on a sharded input:
  DTensor runs torch's kernel on each shard, which divides by the shard's element count,
  not the tensor's, so in torch 2.11-2.13 the gradient comes out (number of shards) times
  too large while the loss is right (NOTE [mean loss backward]).
* ``aten.view`` / ``aten._unsafe_view`` where the local tensor's layout differs from the
  global strides DTensor decided the view on (after a redistribute, the local tensor is
  contiguous and the global strides are not): a view of a contiguous copy where the local
  view is impossible, instead of "view size is not compatible" (NOTE [local view]); and the
  unflatten of a dim DTensor flattened into two _StridedShards (seq sharded over two mesh
  axes, flattened for the loss), which DTensor's view rule cannot undo in torch 2.13
  (NOTE [strided unflatten]); both in meshlm/_torch_compat/dtensor_views.py.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm._torch_compat import dtensor_views
from meshlm._torch_compat.dtensor_base import aten, wrap
from meshlm._torch_compat.dtensor_base import contiguous_stride as _contiguous_stride
from meshlm._torch_compat.dtensor_base import default as _default

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


# --------------------------------------------------------------------------- fallback


# --------------------------------------------------------------------------- mean losses
# NOTE [mean loss backward]
#     For these ops DTensor's rule runs the local backward kernel on each shard with the
#     reduction it was given.  With reduction "mean" the kernel scales by 1/(its input's
#     element count), the shard's, where the loss divided by the whole tensor's count: a
#     batch split over 2 ranks gets gradients 2x too large (found with a user model's
#     F.mse_loss under a data-parallel layout on a 2-D mesh; tests/dist/test_inputs_outputs.py
#     and tests/dist/test_dtensor_rules.py).  The fix scales the result by local / global
#     count, per rank (uneven shards too).  Composite losses (l1, kl_div, poisson, BCE with
#     logits) decompose into ops DTensor reduces correctly and need nothing.
_MEAN_LOSS_BACKWARD = {
    getattr(aten, name).default: i
    for name, i in (
        ("mse_loss_backward", 3),
        ("smooth_l1_loss_backward", 3),
        ("huber_loss_backward", 3),
        ("soft_margin_loss_backward", 3),
        ("binary_cross_entropy_backward", 4),
    )
    if hasattr(aten, name)
}


def _mean_loss_backward_handler(op_call, args, kwargs):
    out = _default(op_call, args, kwargs)
    i = _MEAN_LOSS_BACKWARD[op_call]
    reduction = args[i] if len(args) > i else kwargs.get("reduction", 1)
    x = args[1]
    if reduction != 1 or not isinstance(x, DTensor) or x._local_tensor.numel() == x.numel():
        return out
    return out * (x._local_tensor.numel() / x.numel())


# --------------------------------------------------------------------------- SDPA (CPU)
def _register_sdpa_cpu() -> None:
    from torch.distributed.tensor.experimental import register_sharding

    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is None:
        return

    @register_sharding(fwd.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        out = []
        for d in (0, 1):  # batch or heads
            out.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None]))
        out.append(([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None]))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        res = []
        for d in (0, 1):
            s = Shard(d)
            res.append(([s, s, s], [s, s, s, s, s, s, None, None]))
        r = Replicate()
        res.append(([r, r, r], [r, r, r, r, r, r, None, None]))
        return res


# --------------------------------------------------------------------------- cross entropy
def _class_input(op, args):
    """The argument of a loss op shaped like the logits."""
    if op in (aten._log_softmax.default,):
        return args[0]
    if op == aten._log_softmax_backward_data.default:
        return args[1]
    return args[0] if op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default) else args[1]


def _class_dim(op, args) -> int:
    x = _class_input(op, args)
    if op == aten._log_softmax.default:
        return args[1] % x.dim()
    if op == aten._log_softmax_backward_data.default:
        return args[2] % x.dim()
    return 1 if x.dim() >= 2 else 0  # nll_loss forward/backward


def _class_dim_sharded(op, args) -> bool:
    x = _class_input(op, args)
    if not isinstance(x, DTensor):
        return False
    dim = _class_dim(op, args)
    return any(isinstance(p, Shard) and p.dim == dim for p in x.placements)


def _class_sharded_or_default(op, torch_handler):
    def handler(op_call, args, kwargs):
        if not _class_dim_sharded(op_call, args):
            return _default(op_call, args, kwargs)
        if op_call in _NLL_FWD and _is_mean(args, 3):
            return _nll_mean_forward(torch_handler, op_call, args, kwargs)
        if op_call in _NLL_BWD and _is_mean(args, 4):
            return _nll_mean_backward(torch_handler, op_call, args, kwargs)
        return torch_handler(op_call, args, kwargs)

    return handler


def _handles_nd_meshes(loss_module) -> bool:
    """Whether torch's loss-parallel handlers take logits on a mesh of several dims (torch
    2.13 does; 2.11's raise "only supports input on one-dimensional DeviceMesh")."""
    try:
        loss_module._find_all_reduce_mesh_dim((Replicate(), Shard(1)), 1)
    except ValueError:
        return False
    return True


def _on_class_submesh(torch_handler):
    """torch's one-dimensional loss-parallel handler, run on logits of any mesh.

    NOTE [loss on the class submesh]
        Where torch's handlers take one-dimensional meshes only (2.11), every DTensor
        argument is re-viewed, local tensor unchanged, on the 1-D submesh of the mesh dim
        that shards the class dim (``tp``), and the outputs are viewed back on the whole
        mesh.  On each group of that submesh the rows are this rank's rows of the batch:
        log-softmax and the class gather are per row, so each group computes its rows
        exactly as torch 2.13's N-D handler does.  Back on the whole mesh an output shaped
        like the logits keeps the logits' placements; a per-row loss keeps them with the
        class dim removed; a scalar (a sum over this rank's rows) is Partial(sum) over the
        mesh dims that split the batch, as in 2.13.  No collective is added or removed:
        torch's handler all-reduces over the class submesh only, and the mean's global
        count is summed over the batch dims by ``_nll_mean_forward``."""

    def handler(op_call, args, kwargs):
        x = _class_input(op_call, args)
        mesh = x.device_mesh
        if mesh.ndim == 1:
            return torch_handler(op_call, args, kwargs)
        cdim = _class_dim(op_call, args)
        t = next(i for i, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == cdim)
        sub = mesh[mesh.mesh_dim_names[t]]

        def down(a):
            if not isinstance(a, DTensor):
                return a
            return DTensor.from_local(a._local_tensor, sub, [a.placements[t]], run_check=False)

        def up(o):
            if not isinstance(o, DTensor):
                return o
            pls = []
            for i, p in enumerate(x.placements):
                if i == t:
                    pls.append(o.placements[0])
                elif o.dim() == x.dim():
                    pls.append(p)
                elif o.dim() == 0:
                    pls.append(Partial() if isinstance(p, Shard) else p)
                else:  # per-row loss: the class dim is gone
                    pls.append(Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > cdim else p)
            return DTensor.from_local(o._local_tensor, mesh, pls, run_check=False)

        out = torch_handler(op_call, tuple(down(a) for a in args), {k: down(v) for k, v in kwargs.items()})
        return tuple(up(o) for o in out) if isinstance(out, (tuple, list)) else up(out)

    return handler


_NLL_FWD = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_NLL_BWD = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
_MEAN, _SUM = 1, 2  # torch's Reduction enum values


def _is_mean(args, i) -> bool:
    x = args[0] if i == 3 else args[1]
    return args[i] == _MEAN and x.device_mesh.ndim > 1


def _global_count(x: DTensor, local_count: Tensor) -> Tensor:
    """Sum a per-rank count of targets over the mesh dims that split the batch."""
    from torch.distributed._functional_collectives import all_reduce

    count = local_count
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim != 1 % max(x.dim(), 1):
            count = all_reduce(count, "sum", (x.device_mesh, i))
    return count


def _nll_mean_forward(torch_handler, op_call, args, kwargs):
    # torch's loss-parallel mean divides by a per-rank count on meshes of more than one dim;
    # we take the sum, and divide by the count of targets over the whole batch.
    args = list(args)
    args[3] = _SUM
    total, local_count = torch_handler(op_call, tuple(args), kwargs)
    count = _global_count(args[0], local_count)
    return total / count.to(total.dtype), count


def _nll_mean_backward(torch_handler, op_call, args, kwargs):
    args = list(args)
    count = args[6]  # the global count the forward returned
    args[0] = args[0] / count.to(args[0].dtype)
    args[4] = _SUM
    return torch_handler(op_call, tuple(args), kwargs)


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
    if not isinstance(w, DTensor) or not any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
        return _default(op_call, args, kwargs)
    mesh = w.device_mesh
    vdims, lo, hi = _vocab_range(w)
    if not isinstance(ids, DTensor):
        ids = DTensor.from_local(ids, mesh, [Replicate()] * mesh.ndim, run_check=False)
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
    if isinstance(orig_ids, DTensor):
        _EMB_CTX[id(orig_ids)] = (
            weakref.ref(orig_ids, lambda _r, k=id(orig_ids): _EMB_CTX.pop(k, None)),
            vdims,
            lo,
            hi,
            w._local_tensor.shape[0],
            tuple(ids.placements),
        )
    loc_ids = ids._local_tensor
    miss = (loc_ids < lo) | (loc_ids >= hi)
    local = torch.nn.functional.embedding((loc_ids - lo).masked_fill(miss, 0), w._local_tensor)
    local = local.masked_fill(miss.unsqueeze(-1), 0.0)
    shape = tuple(ids.shape) + (w.shape[1],)
    return wrap(local, mesh, out_pl, shape, _contiguous_stride(shape))


def _embedding_backward_handler(op_call, args, kwargs):
    grad, ids = args[0], args[1]
    ctx = _EMB_CTX.get(id(ids))
    if ctx is None or ctx[0]() is not ids:
        return _default(op_call, args, kwargs)
    _, vdims, lo, hi, rows, id_pl = ctx
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


# id(ids DTensor) -> (weakref to it, vocab mesh dims, lo, hi, local rows, ids placements
# used in forward).  The backward op sees the saved ids but not the weight, so the forward
# leaves what the backward needs keyed by the ids object autograd saves.
_EMB_CTX: dict = {}
