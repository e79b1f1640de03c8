"""Token weighting: a step's loss and gradient are those of its whole batch, whatever the
micro-batches and ranks it is split into.

NOTE [token weighting]
    One device, given the step's whole batch, computes a mean loss as the sum of the
    per-token losses over the batch divided by the batch's total weight (for
    ``F.cross_entropy``: the count of targets that are not ``ignore_index``, or the sum of
    their class weights).  meshlm splits that batch over data-parallel ranks and over
    ``train.grad_accum`` micro-batches (a pipeline's too), and combines the pieces so that
    the result is the same:

    - Over ranks, a loss is combined by the local root (NOTE [local root] in
      lowering/local_root.py): an NLL mean, or a value passed through
      ``meshlm.reduce_batch(x, "mean", weight=w)``, is weighted by each rank's weight; under
      DTensor the loss is computed on the global tensors already.
    - Over micro-batches, the *weight* of micro-batch i's loss L_i is W_i (``weight_of``):
      the global total weight of an NLL mean (read from its autograd node, or attached by
      the local root), or the ``weight`` given to ``reduce_batch``, summed over ranks; any
      other loss has W_i = 1 (a plain mean over equal micro-batches).  The step's loss is
      sum_i W_i L_i / sum_i W_i, and its gradient likewise.  Backward runs as each
      micro-batch ends, before the later weights are known, so micro-batch i back-propagates
      L_i * W_i / R, with R = n * W_first (the first non-zero weight times the number of
      micro-batches, so that gradients keep the size they had as L_i / n), and at the end
      the gradients are multiplied by R / sum_i W_i (``Accumulation``; exactly 1, and
      skipped, when every weight is equal).  A micro-batch with weight 0 (every target
      ignored) adds nothing, as on one device; a step whose total weight is 0 has a NaN loss,
      as one device's mean of nothing has.
    - Every micro-batch of a step must report the same kind of weight (all known or all
      equal): a mixture is an error, since it cannot be combined as one device would.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.core.errors import MeshlmError

ATTR = "_meshlm_weight"  # the global total weight of a loss, where meshlm computed it


def attach(loss: Tensor, weight: Tensor) -> Tensor:
    """Record ``weight`` (the loss's global total weight) on ``loss``; returns ``loss``."""
    setattr(loss, ATTR, weight)
    return loss


def weight_tensor(loss: Tensor) -> Optional[Tensor]:
    """The global total weight ``loss`` is a mean over, as a tensor (NOTE [token
    weighting]): attached by meshlm, or saved by a mean NLL's autograd node (under DTensor,
    the global count); None for a loss of unknown weight."""
    w = getattr(loss, ATTR, None)
    if w is not None:
        return w
    nll = compat.nll_node_fields(loss.grad_fn) if loss.ndim == 0 else None
    return nll[1] if nll is not None and nll[0] == 1 else None


def weight_of(loss: Tensor) -> Optional[float]:
    """``weight_tensor`` as a number (each micro-batch of unknown weight then counts once)."""
    w = weight_tensor(loss)
    return None if w is None else number(w)


def number(w: Tensor) -> float:
    """A weight tensor's value (a DTensor's global value)."""
    return float(w.full_tensor() if isinstance(w, DTensor) else w)


def rescale(factor: float, opt=None, model=None) -> None:
    """Multiply the step's accumulated gradients by ``factor`` (NOTE [token weighting]): a
    ``ShardedOptimizer``'s (its reduced gradients, main and offloaded ones included), else
    those of a plain torch optimizer's parameters, else of ``model``'s parameters."""
    if factor == 1.0:
        return
    if hasattr(opt, "scale_grads"):
        opt.reduce_grads()
        opt.scale_grads(factor)
        return
    params = [p for g in opt.param_groups for p in g["params"]] if opt is not None else list(model.parameters())
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


class Accumulation:
    """One step's micro-batches, combined by weight (NOTE [token weighting]).  For each
    micro-batch's loss, ``coefficient(loss)`` is the factor to back-propagate it with; after
    the last, ``loss()`` is the step's loss and ``grad_factor()`` what to multiply the
    accumulated gradients by."""

    def __init__(self, micro_batches: int):
        self.n = micro_batches
        self.ref: Optional[float] = None
        self.total = 0.0
        self.weighted = 0.0
        self.known: Optional[bool] = None

    def coefficient(self, loss: Tensor) -> float:
        """The factor to back-propagate micro-batch ``loss`` with."""
        return self.add(weight_of(loss), float(loss.detach()))

    def add(self, w: Optional[float], value: float) -> float:
        """``coefficient`` of a micro-batch loss of weight ``w`` (None: unknown) and value ``value``."""
        known = w is not None
        if self.known is not None and known != self.known:
            raise MeshlmError(
                "the micro-batches of one step returned losses of different kinds (a mean NLL or a "
                "meshlm.reduce_batch(..., weight=) on some, another scalar on others), which cannot be combined as "
                "one device would combine the whole batch; return the same kind of loss from every forward"
            )
        self.known = known
        w = 1.0 if w is None else w
        if self.ref is None and w > 0:
            self.ref = w * self.n
        self.total += w
        if w > 0:
            self.weighted += w * value
        return w / self.ref if self.ref else 0.0

    def loss(self) -> float:
        return self.weighted / self.total if self.total > 0 else math.nan

    def grad_factor(self) -> float:
        return self.ref / self.total if self.ref else 1.0
