"""Main gradients: a float32 gradient for a parameter stored in a narrower dtype.

NOTE [main grads]
    Autograd casts every gradient to its leaf's dtype: a bf16 parameter gets a bf16
    ``.grad``, and micro-batches would accumulate in bf16.  ZeRO-1/2 under mixed precision
    store their whole parameters in bf16 (2 bytes per element instead of 4; NOTE [mixed
    precision] in precision.py), so their gradients take the path Megatron (``main_grad``)
    and DeepSpeed use: the backward that reduces a parameter's gradient (the block bucket's
    ``bucket.Gather.backward``, or ``lowering.atuse.AtUse.backward`` per parameter) casts it to
    the reduce dtype (float32), reduces it to the layout's ``grads`` placements, adds it
    into the parameter's float32 ``main_grad`` (a DTensor in those placements, made by the
    first micro-batch: no buffer is allocated ahead of backward) and returns no gradient to
    autograd, so ``.grad`` stays None and no bf16 gradient is ever held.  ZeRO-2's
    ``main_grad`` is this rank's reduce-scattered shard (4 bytes x Ψ/N); ZeRO-1's is the
    whole local, unreduced gradient (4 bytes x Ψ), reduce-scattered at the optimizer step.

    The owner of a ``main_grad`` is ``meshlm.runtime.optim.sharded.ShardedOptimizer``: ``reduce_grads``
    reads it (not ``.grad``) and makes the master's ``.grad`` from it (ZeRO-2: the same
    tensor; ZeRO-1: the reduce-scatter's output, each chunk's ``main_grad`` released as
    soon as its chunk is reduced, so the whole gradient and the shards coexist for at
    most one chunk), and ``zero_grad`` releases them.  So every reader of gradients
    (``grads``, ``grad_norm``, clipping, the loss scaler, ``opt.masters()[fqn].grad``)
    sees float32.

    The master starts from the float32 initial weights, not from the bf16 parameters:
    ``shard`` keeps this rank's optimizer block of them (4 bytes x Ψ/N, the master's own
    memory, made early) until ``ShardedOptimizer`` takes it, so a bf16-stored model trains
    from the same weights as a float32 one.

    With overlap (NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py) the reduced gradient may still
    be in flight when the bucket's backward returns: it is added at the end of the
    backward pass, after waiting for it.  The add runs in the backward's Python code, so
    main gradients need the data-parallel reductions to run eagerly: ``compile_comms=eager``
    under ``torch.compile`` (``meshlm train`` keeps float32 storage otherwise;
    ``compile.compile_blocks`` refuses to compile whole a block whose parameters have main
    gradients, which would get no gradient at all: tests/dist/test_compiled_main_grads.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.runtime import in_flight

ATTR = "main_grad"
SINK = "_meshlm_grad_sink"  # where a parameter's main gradients go instead (NOTE [offloaded gradients])
INIT_MASTER = "_meshlm_init_master"  # the initial weights in the master's dtype and placements


def get(p: Tensor) -> Optional[Tensor]:
    """The parameter's main gradient, or None (none yet, or not a main-grad parameter)."""
    return getattr(p, ATTR, None)


def take_init_master(p: Tensor) -> Optional[DTensor]:
    """The parameter's initial weights before rounding to its storage dtype (in the
    optimizer's placements; ``lowering.materialize``), once: the optimizer takes them as
    its master."""
    init = getattr(p, INIT_MASTER, None)
    if init is not None:
        setattr(p, INIT_MASTER, None)
    return init


def release(p: Tensor) -> None:
    if getattr(p, ATTR, None) is not None:
        setattr(p, ATTR, None)


def accumulate(p: Tensor, g: DTensor, dtype: torch.dtype) -> None:
    """Add the reduced gradient ``g`` (a DTensor in the layout's ``grads`` placements) into
    ``p.main_grad`` in ``dtype`` (NOTE [main grads])."""
    if compat.in_flight(compat.local_tensor(g)):  # added when the backward pass ends (its model's InFlight)
        box = in_flight.of(p)
        box.later(box.mains, (p, g, dtype), _settle)
        return
    _add(p, g, dtype)


def _add(p: Tensor, g: DTensor, dtype: torch.dtype) -> None:
    g = g.detach()
    if g.dtype != dtype:
        g = g.to(dtype)
    sink = getattr(p, SINK, None)
    if sink is not None:  # offloaded: the sink accumulates it on its tier
        sink.accumulate(p, g)
        return
    cur = getattr(p, ATTR, None)
    if cur is None:
        setattr(p, ATTR, g)
        return
    if tuple(cur.placements) != tuple(g.placements) or cur.shape != g.shape:
        raise RuntimeError(
            f"main gradient placed {tuple(cur.placements)} {tuple(cur.shape)} cannot take a gradient "
            f"placed {tuple(g.placements)} {tuple(g.shape)}"
        )
    compat.local_tensor(cur).add_(compat.local_tensor(g))


def _settle(box: in_flight.InFlight) -> None:
    pending, box.mains = box.mains, []
    from meshlm._torch_compat import dtensor_ops

    for p, g, dtype in pending:
        local = compat.local_tensor(g).wait()
        _add(p, dtensor_ops.wrap(local, g.device_mesh, g.placements, g.shape, g.stride()), dtype)
