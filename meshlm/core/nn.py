"""Annotated layers: torch's ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and
``nn.RMSNorm`` that also say which logical axes their parameters have.

Each is a subclass of torch's layer: the same parameters under the same names (so the
same ``state_dict`` keys), the same ``forward``, the same default initialisation when
built on a real device.  What they add:

* the logical axes of their parameters, given per instance (``param_axes``, NOTE [open
  vocabulary] in meshlm/core/axes.py for naming new ones);
* ``init_weights(generator)``, the draw ``meshlm.shard`` replays shard by shard for a model
  built on the meta device (and ``meshlm.init_params`` on one device): torch's default
  distribution, or ``init_std`` for a normal one.

Axes convention.  ``Linear(in_features, out_features, axes=(in_axis, out_axis))`` names
the axes in the order of the sizes, input first, as the layer reads: ``Linear(d, 4 * d,
axes=("embed", "mlp"))`` maps embed to mlp.  torch stores the weight as ``(out, in)``, so
its ``param_axes`` are the reverse, ``weight: ("mlp", "embed")``, and the bias has the
output axis, ``bias: ("mlp",)``.  ``Embedding(num, dim, axes=(row_axis, dim_axis))``
follows the weight's own shape ``(num, dim)``: ``("vocab", "embed")`` for tokens,
``(None, "embed")`` for learned positions.  Norms default to ``axes=("embed",)``.

To port a model written against ``torch.nn``, change the imports to ``meshlm.core.nn`` and name
the axes; to annotate an existing instance of a torch layer instead, ``meshlm.set_axes``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from meshlm.core.annotate import dropout
from meshlm.core.axes import Axes
from meshlm.core.errors import AnnotationError

__all__ = ["Dropout", "Embedding", "LayerNorm", "Linear", "RMSNorm"]


def _axes(cls: str, axes, n: int, what: str) -> Axes:
    ax = (axes,) if isinstance(axes, str) or axes is None else tuple(axes)
    if len(ax) != n or not all(a is None or isinstance(a, str) for a in ax):
        raise AnnotationError(f"meshlm.nn.{cls}(axes={axes!r}): give {n} logical axes (a name or None each): {what}")
    return ax


class Linear(nn.Linear):
    """``torch.nn.Linear`` with logical axes: ``axes=(in_axis, out_axis)`` in the order of
    ``(in_features, out_features)``; the stored weight ``(out, in)`` gets ``(out_axis,
    in_axis)``, the bias ``(out_axis,)`` (module docstring).  ``init_std``: initialise the
    weight from N(0, init_std) and the bias to zero (GPT-2's scheme); None: torch's
    default (uniform in +-1/sqrt(in_features), both)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        axes: Sequence[Optional[str]],
        init_std: Optional[float] = None,
        device=None,
        dtype=None,
    ):
        ax = _axes("Linear", axes, 2, "(in_axis, out_axis), in the order of (in_features, out_features)")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.init_std = init_std
        self.param_axes = {"weight": (ax[1], ax[0])}
        if bias:
            self.param_axes["bias"] = (ax[1],)

    def init_weights(self, gen: torch.Generator) -> None:
        if self.init_std is not None:
            nn.init.normal_(self.weight, std=self.init_std, generator=gen)
            if self.bias is not None:
                nn.init.zeros_(self.bias)
            return
        # torch's reset_parameters, drawn from ``gen``
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=gen)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound, generator=gen)


class Embedding(nn.Embedding):
    """``torch.nn.Embedding`` with logical axes ``axes=(row_axis, dim_axis)`` of its weight
    ``(num_embeddings, embedding_dim)``: ``("vocab", "embed")`` for a token table,
    ``(None, "embed")`` for learned positions.  ``init_std``: N(0, init_std); None:
    torch's default N(0, 1).  A ``padding_idx`` row starts at zero, as in torch."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        axes: Sequence[Optional[str]],
        padding_idx: Optional[int] = None,
        init_std: Optional[float] = None,
        device=None,
        dtype=None,
    ):
        ax = _axes("Embedding", axes, 2, "(row_axis, dim_axis) of the (num_embeddings, embedding_dim) weight")
        super().__init__(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self.init_std = init_std
        self.param_axes = {"weight": ax}

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.weight, std=1.0 if self.init_std is None else self.init_std, generator=gen)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (weight and, by default, bias) with logical axes ``axes`` of
    the normalised dims (default ``("embed",)``).  Initialised to weight 1, bias 0."""

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        axes: Sequence[Optional[str]] = ("embed",),
        device=None,
        dtype=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        ax = _axes("LayerNorm", axes, len(self.normalized_shape), "one per normalised dim")
        self.param_axes = {"weight": ax, "bias": ax} if elementwise_affine else {}

    def init_weights(self, gen: torch.Generator) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` with logical axes ``axes`` of the normalised dims (default
    ``("embed",)``).  Initialised to weight 1."""

    def __init__(
        self,
        normalized_shape,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        *,
        axes: Sequence[Optional[str]] = ("embed",),
        device=None,
        dtype=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        ax = _axes("RMSNorm", axes, len(self.normalized_shape), "one per normalised dim")
        self.param_axes = {"weight": ax} if elementwise_affine else {}

    def init_weights(self, gen: torch.Generator) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)


class Dropout(nn.Dropout):
    """``torch.nn.Dropout`` whose mask is the one-device mask under every layout
    (``meshlm.dropout``; NOTE [dropout keys] in meshlm/core/rng.py): ``axes`` are the logical
    axes of its input, one per dim (``("batch", "seq", "embed")`` for residual dropout)."""

    def __init__(self, p: float = 0.5, *, axes: Sequence[Optional[str]]):
        super().__init__(p)
        self.axes = tuple(axes)

    def forward(self, x: Tensor) -> Tensor:
        if len(self.axes) != x.ndim:
            raise AnnotationError(
                f"meshlm.nn.Dropout(axes={self.axes}): {len(self.axes)} axes for an input of "
                f"{x.ndim} dims {tuple(x.shape)}: give one logical axis (or None) per dim"
            )
        return dropout(x, self.p, self.axes, self.training)
