"""DTensor rules for losses on sharded inputs (part of the adapter in
``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE [private torch]
there):

* ``F.cross_entropy`` on logits sharded over the class dim: torch's loss-parallel handlers
  always on for meshlm's meshes, falling back to DTensor's default rule when the class dim
  is not sharded, with the mean taken over the whole batch on meshes of several dims, and,
  where torch's handlers take one-dimensional meshes only (2.11), run on the class dim's
  submesh (NOTE [loss on the class submesh]).
* The backward of a mean-reduced elementwise loss (``F.mse_loss`` and the like) on a sharded
  input, scaled by the shard's share of the elements (NOTE [mean loss backward]).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm._torch_compat.dtensor_base import aten
from meshlm._torch_compat.dtensor_base import default as _default


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
        args = _rows_of_target(op_call, args)
        if op_call in _NLL_FWD and _is_mean(args, 3):
            return _nll_mean_forward(torch_handler, op_call, args, kwargs)
        if op_call in _NLL_BWD and _is_mean(args, 4):
            return _nll_mean_backward(torch_handler, op_call, args, kwargs)
        return torch_handler(op_call, args, kwargs)

    return handler


def _rows_of_target(op, args) -> tuple:
    """The NLL's target placed as its input's rows (NOTE [target rows]).

    NOTE [target rows]
        torch's loss-parallel handlers require the target to be split exactly as the
        logits' non-class dims are.  Under expert parallel the logits' rows are split over
        ``ep`` inside the model (``batch: [..., ep]``) while the labels, an input, are split
        over the data axes only, so the target is moved to the logits' rows first (a local
        slice: it is replicated where the logits are split)."""
    if op not in _NLL_FWD + _NLL_BWD:
        return args
    ti = 1 if op in _NLL_FWD else 2
    x, t = _class_input(op, args), args[ti]
    if not isinstance(t, DTensor) or not isinstance(x, DTensor):
        return args
    cdim = _class_dim(op, args)
    want = tuple(
        Shard(p.dim - (p.dim > cdim)) if isinstance(p, Shard) and p.dim != cdim else Replicate() for p in x.placements
    )
    if tuple(t.placements) == want:
        return args
    args = list(args)
    args[ti] = t.redistribute(t.device_mesh, want)
    return tuple(args)


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


# --------------------------------------------------------------------------- mean losses
# NOTE [mean loss backward]
#     For these ops DTensor's rule runs the local backward kernel on each shard with the
#     reduction it was given.  With reduction "mean" the kernel scales by 1/(its input's
#     element count), the shard's, where the loss divided by the whole tensor's count: a
#     batch split over 2 ranks gets gradients 2x too large (found with a user model's
#     F.mse_loss under a data-parallel layout on a 2-D mesh; tests/dist/test_inputs_outputs.py
#     and tests/dist/test_dtensor_rules.py).  The fix scales the result by local / global
#     count, per rank (uneven shards too), counted on the gradient: the rule may split the
#     input further than it came (replicated over tp, split over tp where the target is), and
#     the kernel's mean is over the elements it ran on (an MoE stack under fsdp_tp_ep on
#     tp=2 x ep=2 had every gradient 2x before this).  Composite losses (l1, kl_div, poisson, BCE with
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
    # the share of the elements the kernel ran on is the gradient's (laid out as the rule
    # split the input, which may be finer than the input came: a replicated dim split too)
    if reduction != 1 or not isinstance(out, DTensor) or out._local_tensor.numel() == out.numel():
        return out
    return out * (out._local_tensor.numel() / out.numel())
