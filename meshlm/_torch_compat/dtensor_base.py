"""DTensor helpers the op rules share (``dtensor_ops``, ``dtensor_views``, ``dtensor_loss``,
``dtensor_embedding``, ``dtensor_sdpa``): building a DTensor from its spec, and running an op
through DTensor's own rule."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

aten = torch.ops.aten


def wrap(local: Tensor, mesh, placements, shape, stride=None) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)``
    (``stride`` None: a contiguous tensor's of ``shape``)
    for a tensor that no gradient flows back through: gradients made in backward, results
    of gathers inside an autograd Function, outputs of dispatch handlers.  Eager, it builds
    the DTensor from its spec directly, without from_local's autograd node and argument
    normalisation, several times cheaper, which adds up over every parameter's gradient
    in every step.  Traced code (torch.compile) and
    a ``local`` that records autograd go through from_local."""
    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    if (local.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
        )
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local.view_as(local), spec, requires_grad=False)  # a fresh alias, as from_local


def default(op, args, kwargs):
    """Run ``op`` through DTensor's default propagation (our handler removed meanwhile)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = mine


def contiguous_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
