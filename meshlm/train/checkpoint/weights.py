"""Which tensor of a checkpoint the weights load into, and what follows them (checkpoint.py).

NOTE [checkpoint weights]
    Under mixed precision a ZeRO-1/2 parameter is stored in bf16 and its true weights are
    the optimizer's float32 master (NOTE [mixed precision] in precision.py): the bf16
    parameter is that master rounded.  A checkpoint saves both, ``model/<fqn>`` and
    ``master/<fqn>`` (a master is saved where its dtype differs from the parameter's).
    Loading takes the weights from ``master/<fqn>`` when the checkpoint has it, else from
    ``model/<fqn>`` (an fp32 checkpoint: its parameters are the weights), and reads them
    into the widest tensor that holds them on the loading side:

    * a master wider than its parameter (bf16 ZeRO-1/2) takes them; the parameter is then
      the master rounded to its dtype and placed like it, as ``ShardedOptimizer.step``
      refreshes it;
    * otherwise the parameter takes them (fp32 storage is the master; a model loaded
      without an optimizer, as ``meshlm convert`` loads one, gets the fp32 weights), and
      a separate master of the same dtype (fp32 ZeRO-1/2) is copied from it.

    So a resumed bf16 run continues bit for bit, and every change of layout, world size or
    ``param_dtype`` starts from the saved float32 weights, never from their bf16 rounding
    widened.  A load also drops every gradient, main gradients included (NOTE [main grads]
    in main_grad.py): they are gradients of the weights it replaced.  Checkpoints are taken
    at step boundaries; a save mid-accumulation writes the same tensors and leaves the
    pending gradients alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm.runtime import main_grad


def weight_targets(saved, params: dict[str, Tensor], masters: dict[str, Tensor]) -> tuple[dict[str, Tensor], list]:
    """The DCP entries that load the weights (saved key -> the tensor read into), and the
    (destination, source) copies to run after the load (NOTE [checkpoint weights]).
    ``saved``: the checkpoint's keys; ``masters``: FQN -> the optimizer's master (empty
    without an optimizer)."""
    sd: dict[str, Tensor] = {}
    follow: list = []
    for fqn, p in params.items():
        key = f"master/{fqn}" if f"master/{fqn}" in saved else f"model/{fqn}"
        m = masters.get(fqn, p)
        if m is not p and m.dtype != p.dtype:
            sd[key] = m.detach()
            follow.append((p, m))
        else:
            sd[key] = p.detach()
            if m is not p:
                follow.append((m, p))
    return sd, follow


def copy_followers(follow: list) -> None:
    """Each destination := its source, in the destination's dtype and placements."""
    with torch.no_grad():
        for dst, src in follow:
            src = src.detach().to(dst.dtype)
            if isinstance(src, DTensor) and tuple(src.placements) != tuple(dst.placements):
                src = src.redistribute(src.device_mesh, dst.placements)
            dst.copy_(src)


def drop_grads(params: dict[str, Tensor], optimizer: Any) -> None:
    """Release every gradient and main gradient of the model and optimizer."""
    if optimizer is not None and hasattr(optimizer, "zero_grad"):
        optimizer.zero_grad()
    for p in params.values():
        p.grad = None
        main_grad.release(p)
