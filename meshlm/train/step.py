"""One optimizer step of ``meshlm train``: the micro-batches' forward and backward, the
non-finite-loss check, float16 loss scaling, global-norm clipping and the update, and the
validation loss (the learning-rate schedules: meshlm/train/schedule.py).

``train_step`` is what the loop in meshlm/app/train.py calls once per step; what runs the
micro-batches is a ``Passes`` (``accumulate``: one forward and backward per micro-batch,
gradients summed in place), so that the step around them (scaling, clipping, the update,
skipping) is the same whatever produces the gradients.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from meshlm.core.errors import ConfigError, MeshlmError
from meshlm.train.schedule import lr_at  # noqa: F401 (meshlm.train.step's API)

log = logging.getLogger("meshlm.app.train")

#: ``passes(step, scale) -> mean micro-batch loss``: runs forward and backward over the
#: step's micro-batches (each loss divided by their number, then multiplied by ``scale``
#: if given, before backward, so that the gradient is that of the mean loss) and leaves
#: the summed gradients in place.
Passes = Callable[[int, Optional[Callable[[Tensor], Tensor]]], float]


class NonFiniteLossError(MeshlmError):
    """The loss became NaN or Inf."""


@dataclass
class StepOutcome:
    """What a step did: its mean loss, the gradient norm before clipping (None: not
    computed), and why it did not update the weights (None: it did)."""

    loss: float
    grad_norm: Optional[float] = None
    skipped: Optional[str] = None  # "nonfinite" (train.skip_nonfinite) or "overflow" (float16)
    loss_scale: Optional[float] = None  # float16: the scale this step ran at


def model_inputs(batch: tuple, device) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
    """A batch, ``(tokens, targets)`` or ``(tokens, targets, extras)`` (a dict of tensors: more
    inputs of the model, e.g. ``images``), as the model's positional and keyword arguments on
    ``device``: the model is called ``model(tokens, targets, **extras)``."""
    x, y, *rest = batch
    extras = {k: v.to(device) for k, v in rest[0].items()} if rest else {}
    return (x.to(device), y.to(device)), extras


def _no_extras(extras: dict) -> None:
    if extras:
        raise ConfigError(
            f"a pipelined layout cannot feed the model inputs beyond tokens and targets ({', '.join(extras)}, "
            "from data.format=images); use a layout without layers: pp"
        )


def evaluate(model, loader, batches: int, mcfg, device) -> float:
    """The mean loss over the first ``batches`` batches of ``loader`` (at most an epoch),
    in eval mode (no dropout) and without gradients; the model is back in train mode after.
    ``model``: a sharded model, or a ``meshlm.runtime.pipeline.Pipeline``."""
    from meshlm.models.node import loss_of
    from meshlm.runtime.pipeline import Pipeline

    n = min(batches, loader.steps_per_epoch)
    total = 0.0
    net = model.model if isinstance(model, Pipeline) else model
    net.eval()
    try:
        with torch.no_grad():
            if isinstance(model, Pipeline):  # forward only, stage after stage
                inputs = [model_inputs(loader.next(), device) for _ in range(n)]
                for _, extras in inputs:
                    _no_extras(extras)
                return model.evaluate(inputs)
            for _ in range(n):
                args, extras = model_inputs(loader.next(), device)
                total += float(loss_of(model(*args, **extras), mcfg))
    finally:
        net.train()
    return total / n


def accumulate(model, next_batch, t, mcfg, device, rank: int, opt=None) -> Passes:
    """Gradient accumulation: ``t.grad_accum`` micro-batches of forward and backward,
    weighted as one device would weight the step's whole batch (NOTE [token weighting] in
    meshlm/core/weighting.py): each micro-batch's loss back-propagated with its coefficient, and
    the accumulated gradients rescaled at the end where the weights were unequal (``opt``'s,
    else ``model``'s).  ``next_batch()`` gives (tokens, targets), or (tokens, targets,
    extras), for ``model(tokens, targets, **extras)`` (:func:`model_inputs`); ``scale`` (set
    by ``train_step``) multiplies each micro-batch loss before backward (float16 loss
    scaling).  Each micro-batch's forward starts from torch's generators seeded by
    (``t.seed``, step, micro-batch) (``meshlm.core.rng.seed_forward``, NOTE [dropout keys]).
    Returns the step's weighted loss.  The injected faults of ``train.inject_nan_step`` and
    ``train.inject_crash_step`` (tests) are raised here."""
    from meshlm.core.rng import seed_forward
    from meshlm.core.weighting import Accumulation, rescale
    from meshlm.models.node import loss_of

    def passes(step: int, scale: Optional[Callable[[Tensor], Tensor]] = None) -> float:
        acc = Accumulation(t.grad_accum)
        for j in range(t.grad_accum):
            args, extras = model_inputs(next_batch(), device)
            seed_forward(t.seed, step, j)
            loss = loss_of(model(*args, **extras), mcfg)
            coef = acc.coefficient(loss)
            if step == t.inject_nan_step:
                loss = loss * float("nan")
                acc.weighted = float("nan")
            if t.inject_crash_step == step and rank == t.inject_crash_rank:
                raise RuntimeError(f"injected crash on rank {rank} at step {step} (train.inject_crash_step)")
            micro = loss * coef
            (scale(micro) if scale else micro).backward()
        rescale(acc.grad_factor(), opt, model)
        return acc.loss()

    return passes


def train_step(passes: Passes, opt, t, step: int, lr: float, scaler=None, after_backward=None) -> StepOutcome:
    """Run ``passes`` for ``step``, then update: clip to ``t.grad_clip`` and step ``opt``,
    or, with a float16 ``scaler``, unscale, check for overflow (one all-reduce), clip and
    step or skip.  A non-finite mean loss raises :class:`NonFiniteLossError`, or, with
    ``t.skip_nonfinite``, zeroes the gradients and skips the update.  ``after_backward()``
    is called between the last backward and the update (memory measurement)."""
    loss = passes(step, scaler.scale_loss if scaler is not None else None)
    if after_backward is not None:
        after_backward()
    if not math.isfinite(loss):
        if not t.skip_nonfinite:
            raise NonFiniteLossError(
                f"loss is {loss} at step {step} (lr {lr:.3g}); lower train.lr, keep train.grad_clip > 0, "
                "or set train.skip_nonfinite=true to skip such steps"
            )
        opt.zero_grad()
        log.warning("step %d: loss %s, step skipped (train.skip_nonfinite)", step, loss)
        return StepOutcome(loss, skipped="nonfinite")
    if scaler is not None:  # unscale, one all-reduce for inf/nan, clip, step or skip
        scale = scaler.scale
        gnorm, stepped = scaler.step(opt, t.grad_clip)
        opt.zero_grad()
        if not stepped:
            log.warning(
                "step %d: float16 gradients overflowed at loss scale %g, step skipped; scale now %g",
                step,
                scale,
                scaler.scale,
            )
            return StepOutcome(loss, skipped="overflow", loss_scale=scale)
        return StepOutcome(loss, gnorm, loss_scale=scale)
    gnorm = float(opt.clip_grad_norm_(t.grad_clip)) if t.grad_clip > 0 else None
    opt.step()
    opt.zero_grad()
    return StepOutcome(loss, gnorm)
