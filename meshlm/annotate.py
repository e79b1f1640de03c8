"""What model code imports: the ``param_axes`` contract, ``constrain`` and ``block``.

A module declares the logical axes of its own parameters as class-level data::

    class MLP(nn.Module):
        param_axes: ClassVar[dict[str, Axes]] = {"w_up": ("mlp", "embed"), ...}

and marks activations with ``constrain(x, ("batch", "seq", "embed"))``.  Without
lowering, annotations are data and ``constrain`` is the identity, so every model runs
unchanged on one device as plain PyTorch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from meshlm.axes import Axes

__all__ = ["Axes", "constrain", "block", "is_block", "init_params", "param_axes_of"]

# The active constraint handler: set by the lowering while a sharded module runs its
# forward, None otherwise (then ``constrain`` is the identity).
_handler: Optional[Callable[[Tensor, Axes], Tensor]] = None


def constrain(x: Tensor, axes: Axes) -> Tensor:
    """Mark activation ``x`` as having logical ``axes`` (one name or None per dim).

    Under a layout this redistributes ``x`` to the layout's compute placements; on its
    own it returns ``x`` unchanged.
    """
    h = _handler
    return x if h is None else h(x, axes)


def block(cls: type) -> type:
    """Class decorator: this module is a block, the unit of per-block torch.compile,
    activation checkpointing and parameter re-gathering in backward."""
    cls.__meshlm_block__ = True
    return cls


def is_block(m: nn.Module) -> bool:
    return bool(getattr(type(m), "__meshlm_block__", False))


def param_axes_of(m: nn.Module) -> dict[str, Axes]:
    """The ``param_axes`` a module declares (merged along its class hierarchy)."""
    out: dict[str, Axes] = {}
    for klass in reversed(type(m).__mro__):
        out.update(getattr(klass, "__dict__", {}).get("param_axes", {}) or {})
    return out


def init_params(root: nn.Module, seed: int) -> None:
    """The canonical initialisation: one generator seeded with ``seed``, and each module's
    ``init_weights(generator)`` (which fills that module's *own* parameters, not its
    children's) called in ``root.modules()`` order.  The lowering replays exactly this
    order shard by shard, so a sharded model initialised from a seed equals the one-device
    model of the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in root.modules():
            fn = getattr(m, "init_weights", None)
            if callable(fn):
                fn(gen)
