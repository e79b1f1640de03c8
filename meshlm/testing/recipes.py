"""The float32 recipe of ``check_training`` and the step helpers every recipe shares
(``meshlm.testing.parity``, ``meshlm.testing.parity_mp``)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm.testing import tolerances as tol


def full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def forward_seed(seed: int, step: int, micro: int) -> int:
    return 7919 * seed + 1000 * step + micro


def accumulate(model: nn.Module, micro_batches: list, grad_accum: int, seed: int, step: int) -> list[Tensor]:
    """Forward and ``(loss / grad_accum).backward()`` per micro-batch, as meshlm.train does."""
    losses = []
    for j, (args, kwargs) in enumerate(micro_batches):
        torch.manual_seed(forward_seed(seed, step, j))
        loss = model(*args, **kwargs)
        (loss / grad_accum).backward()
        losses.append(full(loss))
    return losses


class FP32:
    """The float32 recipe: the model as built, float32 throughout; one-step tolerances of
    float32 summation order (``tolerances.LOSS_RTOL``, ``grad_tol``).  The interface of a
    recipe (``parity_mp.BF16`` is the other one)."""

    grad_dtype: torch.dtype | None = None  # the dtype every gradient must reach backward's end in (None: any)

    def shard_dtypes(self, layout: str, mesh, compile: str | None, comms: str) -> dict:
        """``meshlm.shard`` dtype arguments of the sharded model."""
        return {}

    def accumulate(self, model: nn.Module, micro: list, grad_accum: int, seed: int, step: int) -> list[Tensor]:
        """One step's micro-batches through a plain torch model: the losses; the accumulated
        gradients in its parameters' ``.grad``."""
        return accumulate(model, micro, grad_accum, seed, step)

    def probe_weights(self, model: nn.Module, opt) -> dict[str, Tensor]:
        """The weights (gathered, as the probe's float32 parameters) the sharded model steps from."""
        return {n: full(p) for n, p in model.named_parameters()}

    @contextlib.contextmanager
    def watching(self, mesh, what: str):
        """Around a step's forwards, backwards and gradient reduction, which it may check;
        gives a context to enter around the reduction at the step."""
        yield contextlib.nullcontext

    def tolerances(
        self, job, weights: dict, micro: list, losses: list, grads: dict, seed: int, step: int
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """The one-step tolerances (per micro-batch loss, per parameter gradient) at the
        probe's ``weights``, given the probe's ``losses`` and ``grads``."""
        return [tol.LOSS_RTOL * x.abs() for x in losses], {n: tol.grad_tol(g) for n, g in grads.items()}
