"""The autograd op of a bucket: gather a block's parameters at its entry, reduce their
gradients in backward (NOTE [block buckets] in meshlm/runtime/bucket/__init__.py)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_ops
from meshlm.core.state import RUN, counting, eager
from meshlm.runtime import in_flight, main_grad, unused
from meshlm.runtime.bucket.flat import flat_moves, is_sum_partial
from meshlm.runtime.bucket.prefetch import gather_locals
from meshlm.runtime.bucket.spec import BUCKETS, grad_target


class Gather(torch.autograd.Function):
    """Forward: the block's stored parameters -> compute (plain local tensors for a local
    block).  Backward: their gradients -> the layout's ``grads`` placements."""

    @staticmethod
    def forward(ctx, key: int, local: bool, *params):  # type: ignore[override]
        b = BUCKETS[key]
        ctx.key, ctx.local, ctx.params = key, local, params
        # NOTE [unused parameters] in meshlm/runtime/unused.py: an output nothing used gets None, not zeros
        ctx.set_materialize_grads(False)
        with counting("gathering"):
            # A gather issued ahead for this block is taken whatever the block (a pipeline step
            # issues its stages' at its start: NOTE [stage gathers ahead] in pipeline/pipe.py);
            # the next block's is issued here only under overlap, for local blocks (NOTE [prefetch]).
            site = RUN.site if eager() else None
            xs = gather_locals(b, params, site, neighbour=b.overlap and local)
            out = []
            for x, p, m in zip(xs, params, b.members):
                if x is compat.local_tensor(p):  # nothing moved: a fresh alias, not the stored tensor
                    x = x.view_as(x)
                out.append(x if local else dtensor_ops.wrap(x, b.mesh, m.compute, m.shape, m.stride))
            # a local bucket that reduces over other ranks fills an unused member's gradient
            # with zeros of its local shape (every rank packs the same flat collective)
            ctx.fill = [(tuple(x.shape), x.dtype, x.device) for x in xs] if local and max(b.sizes) > 1 else None
            return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        b = BUCKETS[ctx.key]
        n = len(b.members)
        xs: list = [None] * n
        pls: list = [None] * n
        for j, g in enumerate(grads):
            if ctx.fill is not None:  # NOTE [unused parameters] in meshlm/runtime/unused.py
                if g is None:
                    shape, dtype, device = ctx.fill[j]
                    g = torch.zeros(shape, dtype=dtype, device=device)
                    unused.mark_filled(ctx.params[j])
                else:
                    unused.mark_used(ctx.params[j])
            if g is None:
                continue
            if ctx.local:  # NOTE [local blocks]: this rank's share of a sum over every mesh axis
                m = b.members[j]
                xs[j], pls[j] = g, [_SUM if n > 1 else (m.grads or m.storage)[i] for i, n in enumerate(b.sizes)]
            else:
                xs[j], pls[j] = g.to_local(), list(g.placements)
        live = [j for j in range(n) if xs[j] is not None]
        targets = {j: grad_target(b.members[j], pls[j]) for j in live}
        # Which flat collectives each gradient goes through; gradients with the same route
        # share their buffers, so a buffer is freed as a whole (none outlives its last use).
        route = {
            j: tuple(
                (i, type(targets[j][i]).__name__)
                for i in range(len(b.sizes))
                if is_sum_partial(pls[j][i]) and not targets[j][i].is_partial()
            )
            for j in live
        }
        other = tuple(i for i in range(len(b.sizes)) if i not in b.data_dims)
        # Reduce-scatters over data axes, outer axis first; then all-reduces on the scattered
        # shards (HSDP all-reduces 1/fsdp of the gradient over dp); then the other axes (the
        # norm weights' tp reduction under sequence parallelism), again on the shards.
        order = [(k, i) for dims_ in (b.data_dims, other) for k in ("rs", "ar") for i in dims_]
        tg = [targets.get(j) for j in range(n)]
        # The reductions sum in the reduce dtype, each gradient cast as it is packed (NOTE
        # [reduce in place of the casts]); one that no flat collective moved is cast here.
        flat_moves(xs, pls, tg, b.sizes, b.groups, order, key=route, wait=not b.overlap, dtype=b.reduce_dtype)
        out: list = [None] * n
        for j in live:
            m = b.members[j]
            if b.reduce_dtype is not None and xs[j].dtype != b.reduce_dtype:
                xs[j] = xs[j].to(b.reduce_dtype)
            gshape = list(xs[j].shape)
            for i, pl in enumerate(pls[j]):
                if isinstance(pl, Shard):
                    gshape[pl.dim] *= b.sizes[i]
            g = dtensor_ops.wrap(xs[j], b.mesh, pls[j], gshape, m.stride)
            if tuple(g.placements) != targets[j]:  # anything else: per parameter
                g = g.redistribute(b.mesh, targets[j])
            if b.grad_dtype is not None and b.grad_dtype != m.dtype:  # NOTE [main grads]: none to autograd
                main_grad.accumulate(ctx.params[j], g, b.grad_dtype)
                continue
            if g.dtype != m.dtype:
                g = g.to(m.dtype)
            if compat.in_flight(compat.local_tensor(g)):
                _settle_later(ctx.params[j])
            out[j] = g
        return (None, None, *out)


# NOTE [overlapped reduction]
#     With ``overlap`` (``shard(..., overlap=True)``; the default on CUDA), in eager mode a
#     block's gradient reduction is left in flight when its backward returns (the gradient's local tensor is an AsyncCollectiveTensor), so it overlaps the
#     backward of the blocks before it, as DDP's and FSDP's reducers do.  Anything that reads
#     the gradient before then waits for it; at the end of the backward pass a callback
#     waits for every pending one and stores plain tensors in ``.grad``.  Traced code waits
#     in the graph (the compiler schedules it), so nothing is pending there.  On a CPU mesh
#     it is off by default: gloo's communication threads compete with the compute for the
#     same cores, and measured on a 2-core machine with 4 ranks (llama_small, seq 128) overlap
#     made the backward slower (ddp 0.430 s against 0.399 s; benchmarks/step_phases.py
#     --overlap both, docs/benchmarks.md).
# The parameters whose gradient is still in flight wait on their model's InFlight
# (meshlm/runtime/in_flight.py), which the backward pass's end drains.
def _settle_later(param) -> None:
    box = in_flight.of(param)
    box.later(box.grads, param, settle)


def settle(box: in_flight.InFlight) -> None:
    """Wait for the gradients ``box`` holds and store them as plain-tensor DTensors."""
    pending, box.grads = box.grads, []
    for p in pending:
        g = p.grad
        if isinstance(g, DTensor) and compat.in_flight(compat.local_tensor(g)):
            p.grad = dtensor_ops.wrap(compat.local_tensor(g).wait(), g.device_mesh, g.placements, g.shape, g.stride())


_SUM = Partial("sum")


@compat.allow_in_graph
def gather(key: int, local: bool, *params):
    """``Gather`` as one opaque node for Dynamo (NOTE [at-use under compile] in lowering/atuse.py)."""
    return Gather.apply(key, local, *params)
