"""The bf16 rounding of every tensor of a step, measured on one device with plain torch: what
a bf16 side's tolerances are made of (NOTE [diff tolerances] in meshlm/train/diff/compare.py,
NOTE [mixed-precision parity] in meshlm/train/tolerances.py).

``calibrate(model, micro_batches)`` runs the step's forward and backward three times on a
plain copy of ``model`` (no lowering, no process group), with the same recorder as the
sides: in float32 at the float32 weights, in float32 at the weights rounded to bf16, and in
bf16 (the weights rounded to nearest, every activation and activation gradient in bf16, the
gradients accumulated in float32: the recipe ``meshlm train`` runs under
``train.param_dtype=bfloat16``).  For every recorded tensor it returns

    ε = max |bf16 - float32 at the rounded weights|     (the rounding of the computation)
    δ = max |bf16 - float32 at the float32 weights|     (and of the weights)

each the largest over the tensor's elements: one element's error can vanish by chance, so
the scale of the rounding process is taken per tensor, as the parity tests take it per
parameter.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from meshlm.core.rng import seed_forward
from meshlm.core.weighting import Accumulation
from meshlm.train.diff.capture import Recorder


def _run(
    model: nn.Module, micro: list, seed: int, step: int, loss_of: Optional[Callable[[Any], Tensor]]
) -> dict[tuple, Tensor]:
    """The forward records, the step's loss and the float32-accumulated gradients of one
    plain run of ``model`` over ``micro``."""
    rec = Recorder(model)
    acc = Accumulation(len(micro))
    grads: dict[str, Tensor] = {}
    with rec.watching():
        for j, (args, kwargs) in enumerate(micro):
            seed_forward(seed, step, j)
            out = model(*args, **kwargs)
            loss = out if loss_of is None else loss_of(out)
            (loss * acc.coefficient(loss)).backward()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        g = p.grad.float()
                        grads[n] = g if n not in grads else grads[n] + g
                        p.grad = None
    out = {r.key: r.value.float() for r in rec.records(len(micro))}
    out[("loss", "", "loss")] = torch.tensor(acc.loss(), dtype=torch.float64)
    factor = acc.grad_factor()
    for n, g in grads.items():
        module, _, name = n.rpartition(".")
        out[("grad", module, name)] = g * factor
    return out


def calibrate(
    model: nn.Module,
    micro_batches: list[tuple[tuple, dict]],
    *,
    seed: int = 0,
    step: int = 1,
    loss_of: Optional[Callable[[Any], Tensor]] = None,
) -> dict[tuple, tuple[float, float]]:
    """(ε, δ) of every tensor of one step of the plain float32 ``model`` on the whole
    ``micro_batches`` (module docstring), by record key."""
    m32 = copy.deepcopy(model).float()
    rounded = copy.deepcopy(model).to(torch.bfloat16).float()
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    at32 = _run(m32, micro_batches, seed, step, loss_of)
    at_rounded = _run(rounded, micro_batches, seed, step, loss_of)
    low = _run(m16, micro_batches, seed, step, loss_of)
    out = {}
    for key, x in low.items():
        eps = _largest(x, at_rounded.get(key))
        delta = _largest(x, at32.get(key))
        if eps is not None and delta is not None:
            out[key] = (eps, delta)
    return out


def _largest(x: Tensor, y: Optional[Tensor]) -> Optional[float]:
    if y is None or x.shape != y.shape:
        return None
    d = (x.double() - y.double()).abs()
    return float(d.max()) if d.numel() else 0.0
