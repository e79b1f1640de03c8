"""Mixed precision: the reduction dtype ``shard`` defaults to, and dynamic loss scaling.

NOTE [mixed precision]
    ``meshlm train`` runs mixed precision with FSDP2's semantics (its MixedPrecisionPolicy;
    Megatron's fp32 gradient reduction and accumulation are the same): the stored shards
    are float32 and are the master weights (the optimizer keeps no second copy); parameters
    are cast to ``train.param_dtype`` at use, before any gather (so ZeRO-3's gathers move
    half the bytes); the cast's backward returns the gradient to float32 before it is
    reduced (``reduce_dtype``: float32), so gradients are reduced, accumulated over
    micro-batches in ``.grad``, clipped and applied in float32.  The at-use cast is
    ``lower._AtUse`` (per parameter) and ``bucket._compute_locals`` (a block's flat gather);
    their backwards (``_AtUse.backward``, ``bucket._Gather.backward``) cast to the reduce
    dtype, reduce, and cast to the storage dtype.

    float16 also needs loss scaling (its smallest normal number is 6e-5: small gradients of
    activations underflow, large ones overflow at 65504): :class:`LossScaler`.  bfloat16 has
    float32's exponent range and needs none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

log = logging.getLogger("meshlm.precision")


def default_reduce_dtype(compute_dtype: torch.dtype | None,
                         storage: Sequence[torch.dtype]) -> torch.dtype | None:
    """``shard(reduce_dtype=None)``: float32 when the compute dtype or any storage dtype is
    a float narrower than 32 bits, else None (each gradient is reduced in its own dtype)."""
    narrow = [d for d in (compute_dtype, *storage) if d is not None and d.is_floating_point and d.itemsize < 4]
    return torch.float32 if narrow else None


class LossScaler:
    """Dynamic loss scaling for float16 compute, as ``torch.amp.GradScaler`` does it, on a
    :class:`meshlm.optim.ShardedOptimizer`.

    Each micro-batch's loss is multiplied by ``scale`` before backward (:meth:`scale_loss`);
    :meth:`step` then divides the (float32) gradients by it, takes their global norm, which
    is one all-reduce over the mesh, so every rank sees the same value and makes the same
    decision, and either skips the step (a non-finite norm: some gradient overflowed;
    the scale is multiplied by ``backoff_factor``) or clips to ``max_norm`` with that same
    norm and steps (after ``growth_interval`` such steps in a row the scale is multiplied
    by ``growth_factor``).  Powers of two keep the scaling exact.  ``state_dict`` holds the
    scale and the count of good steps; ``meshlm train`` saves it in its checkpoints."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                             f"{backoff_factor}, growth_interval={growth_interval}): need init_scale > 0, "
                             "growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps in a row since the scale last changed
        self.skipped = 0  # steps skipped for overflow (this process's lifetime)

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, opt) -> Tensor:
        """Divide every gradient by the scale (in the optimizer's placements and dtype) and
        return their global norm: non-finite iff some gradient on some rank is."""
        opt.reduce_grads()
        inv = 1.0 / self.scale
        for g in opt.grads():
            g.mul_(inv)
        return opt.grad_norm()

    def step(self, opt, max_norm: float = 0.0) -> tuple[float, bool]:
        """Unscale, check, clip (``max_norm`` > 0) and step ``opt``, or skip the step on an
        overflow; update the scale.  Returns (the unscaled gradient norm, stepped)."""
        norm = float(self.unscale_(opt))
        if not math.isfinite(norm):
            opt.zero_grad()
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return norm, False
        if max_norm > 0:
            opt.clip_grad_norm_(max_norm, norm=norm)
        opt.step()
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return norm, True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
