"""The routed experts' SwiGLU over their slots, on local tensors once the tokens are on
their expert's rank.

NOTE [local experts]
    ``experts(xe, w_gate, w_up, w_down)`` is ``w_down[e] @ (silu(w_gate[e] @ x) * (w_up[e] @
    x))`` for every slot ``x`` of every expert ``e`` (NOTE [moe routing] in meshlm/core/moe.py):
    three batched matmuls over the expert dim and an elementwise product.  Under a layout,
    each of these ops on DTensors pays DTensor's per-op dispatch (sharding propagation, the
    views einsum decomposes into, their wrappers, in forward and again in backward), while
    every rank already holds what its share needs: a dim of the buffer ``xe`` ``(batch,
    experts, capacity, embed)`` and of the weights is split over a mesh dim in one of three
    ways that need no communication inside the experts:

    - ``batch``: ``xe`` split by rows, the weights whole (``Replicate``) on that mesh dim:
      each rank runs its rows; the weights' gradients are partial sums over it;
    - ``experts``: ``xe`` and the weights split by expert alike: each rank runs its experts;
    - ``mlp``: ``xe`` whole, ``w_gate`` and ``w_up`` split by output row and ``w_down`` by
      input column: each rank computes its slice of the hidden units, and the output is a
      partial sum over that mesh dim (which the ``constrain`` after it reduces), as is the
      gradient of ``xe``;

    or nothing is split on it (all ``Replicate``).  Then the experts run as one local
    computation: the inputs enter through ``to_local`` (whose backward hands autograd the
    gradients with the placements above: partial where they are sums over ranks) and the
    output leaves through one ``from_local``: the same math on the same local tensors as
    DTensor's ops, without their dispatch.  Any other placement (``embed`` split, a partial
    input, another mesh) runs the DTensor ops as written.  The hidden activations are
    constrained ``("batch", "experts", None, "mlp")`` on the DTensor path; on the local path
    they are already placed so, and observers (``meshlm.core.annotate.observing``) are shown
    them as a DTensor all the same.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm._torch_compat.dtensor_base import wrap
from meshlm.core.annotate import constrain
from meshlm.core.state import RUN

__all__ = ["experts"]

_H_AXES = ("batch", "experts", None, "mlp")


def experts(xe: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """``(batch, experts, capacity, embed)`` slots -> the experts' SwiGLU outputs, same shape
    (NOTE [local experts])."""
    plan = _plan(xe, w_gate, w_up, w_down)
    if plan is None:
        return _swiglu(xe, w_gate, w_up, w_down, lambda h: constrain(h, _H_AXES))
    return _local(plan, xe, w_gate, w_up, w_down)


def _swiglu(xe, w_gate, w_up, w_down, on_hidden):
    h = F.silu(torch.einsum("becd,emd->becm", xe, w_gate)) * torch.einsum("becd,emd->becm", xe, w_up)
    return torch.einsum("becm,edm->becd", on_hidden(h), w_down)


def _plan(xe, w_gate, w_up, w_down) -> Optional[list[str]]:
    """Per mesh dim, how the experts split over it ("batch", "experts", "mlp", or "" for
    nothing), or None if the DTensor ops must run (NOTE [local experts])."""
    ts = (xe, w_gate, w_up, w_down)
    if not all(isinstance(t, DTensor) for t in ts) or torch.compiler.is_compiling():
        return None
    mesh = xe.device_mesh
    if any(t.device_mesh != mesh for t in ts[1:]):
        return None
    plan = []
    for px, pg, pu, pd in zip(xe.placements, w_gate.placements, w_up.placements, w_down.placements):
        if all(isinstance(p, Replicate) for p in (px, pg, pu, pd)):
            plan.append("")
        elif px == Shard(0) and all(isinstance(p, Replicate) for p in (pg, pu, pd)):
            plan.append("batch")
        elif px == Shard(1) and pg == pu == pd == Shard(0):
            plan.append("experts")
        elif isinstance(px, Replicate) and pg == pu == Shard(1) and pd == Shard(2):
            plan.append("mlp")
        else:
            return None
    return plan


def _local(plan: list[str], xe: DTensor, w_gate: DTensor, w_up: DTensor, w_down: DTensor) -> DTensor:
    """The experts on local tensors, the output lifted back (NOTE [local experts])."""
    x = xe.to_local(grad_placements=[Partial() if k == "mlp" else p for k, p in zip(plan, xe.placements)])
    ws = [
        w.to_local(grad_placements=[Partial() if k == "batch" else p for k, p in zip(plan, w.placements)])
        for w in (w_gate, w_up, w_down)
    ]
    mesh = xe.device_mesh
    e, m = w_gate.shape[0], w_gate.shape[1]
    b, _, c, d = xe.shape

    def show(h: Tensor) -> Tensor:
        if RUN.observers:
            pl = [Shard(3) if k == "mlp" else p for k, p in zip(plan, xe.placements)]
            shape = (b, e, c, m)
            dt = wrap(h.detach(), mesh, pl, shape)
            for fn in RUN.observers:
                fn(dt, _H_AXES)
        return h

    y = _swiglu(x, *ws, show)
    shape = (b, e, c, d)
    pl = [Partial() if k == "mlp" else p for k, p in zip(plan, xe.placements)]
    return wrap(y, mesh, pl, shape)
