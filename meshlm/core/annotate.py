"""What model code imports: the ``param_axes`` contract, ``constrain`` and ``block``.

A module declares the logical axes of its own parameters as class-level data::

    class MLP(nn.Module):
        param_axes: ClassVar[dict[str, Axes]] = {"w_up": ("mlp", "embed"), ...}

or per instance, any module, torch's own included: ``set_axes(module, weight=("vocab",
"embed"))``, or an instance attribute ``param_axes`` (``meshlm.nn``'s layers take theirs
as constructor arguments).  An instance's entries override its class's.  New logical axes
are declared the same way (``logical_axes``, ``declare_axes``; NOTE [open vocabulary] in
meshlm/core/axes.py).  A module marks activations with ``constrain(x, ("batch", "seq", "embed"))``.  Without
lowering, annotations are data and ``constrain`` is the identity, so every model runs
unchanged on one device as plain PyTorch.  ``dropout(x, p, axes)`` is dropout whose mask
is the one-device mask under every layout (NOTE [dropout keys] in meshlm/core/rng.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from meshlm.core import state
from meshlm.core.axes import Axes
from meshlm.core.state import RUN

__all__ = [
    "Axes",
    "block",
    "constrain",
    "declare_axes",
    "dropout",
    "init_params",
    "is_block",
    "param_axes_of",
    "reduce_batch",
    "set_axes",
]


def active_handler() -> Optional[Callable[[Tensor, Axes], Tensor]]:
    """The constraint handler in effect here, or None: the run state's ``handler`` (set by
    the lowering while a sharded module runs its forward, ``state.scope(handler=...)``;
    None otherwise, and then ``constrain`` is the identity).  A handler may also have
    ``dropout(x, p, axes, key)`` and ``reduce_batch(x, op)`` methods (meshlm.core.rng.Handler);
    without them, ``dropout`` is the one-device dropout and ``reduce_batch`` the identity.
    Code that torch.compile traces reads it too, and recompiles for another handler (NOTE
    [run state] in meshlm/core/state.py)."""
    return RUN.handler


def swap_handler(handler: Optional[Callable[[Tensor, Axes], Tensor]]) -> tuple:
    """Make ``handler`` the constraint handler until :func:`restore_handler` is given what
    this returns (a scope's module hooks: NOTE [scoped layouts] in meshlm/core/scopes.py)."""
    return state.swap(handler=handler)


def restore_handler(saved: tuple) -> None:
    state.restore(saved)


def check_axes_count(x: Tensor, axes: Axes) -> None:
    """A handler's check that ``constrain`` was given one logical axis per dim of ``x``."""
    if len(axes) != x.ndim:
        from meshlm.core.errors import AnnotationError

        raise AnnotationError(
            f"constrain: {len(axes)} logical axes {tuple(axes)} for a tensor of {x.ndim} dims {tuple(x.shape)}: "
            "give one logical axis (or None) per dim"
        )


def constrain(x: Tensor, axes: Axes) -> Tensor:
    """Mark activation ``x`` as having logical ``axes`` (one name or None per dim).

    Under a layout this redistributes ``x`` to the layout's compute placements; on its
    own it returns ``x`` unchanged.
    """
    h = active_handler()
    out = x if h is None else h(x, axes)
    for fn in RUN.observers:
        fn(out, axes)
    return out


def observing(fn: Callable[[Tensor, Axes], None]) -> state.scope:
    """``with observing(fn):`` call ``fn(x, axes)`` after every ``constrain`` inside the block
    (the constrained tensor, as the handler returned it, and its logical axes).  Observers see,
    they change nothing: ``constrain`` returns the same tensor with or without them (``meshlm
    diff`` records activations through them: meshlm/train/diff/capture.py).  They are a field
    of the run state (NOTE [run state] in meshlm/core/state.py), which traced code reads."""
    return state.scope(observers=(*RUN.observers, fn))


def reduce_batch(x: Tensor, op: str = "mean", weight: Optional[Tensor] = None) -> Tensor:
    """Declare that ``x`` (a loss, a metric, a per-class count) is a reduction over the
    batch rows this forward sees: ``"mean"`` (a mean over rows) or ``"sum"``.

    On one device, and wherever the model runs on the whole global batch, ``x`` already is
    that value and comes back unchanged.  Where a data-parallel layout runs the model's
    root on each rank's own rows (NOTE [local root] in meshlm/runtime/lowering/local_root.py), it becomes the
    reduction over the global batch: a sum is summed over ranks; a mean is averaged over
    ranks weighted by ``weight``, or by each rank's count of targets that are not ignored
    for a mean ``F.cross_entropy`` / ``F.nll_loss``, or equally (every rank has the same
    number of rows) for any other mean.  Gradients flow to every rank's share.

    ``weight`` (``"mean"`` only): the total weight ``x`` averages over on these rows, for a
    mean of your own, e.g. a masked token mean::

        loss = meshlm.reduce_batch((per_token * mask).sum() / mask.sum(), "mean", weight=mask.sum())

    is the one-device mean over the whole batch's counted tokens under every layout, and
    ``train.grad_accum`` combines micro-batches by the same weight (NOTE [token weighting]
    in meshlm/core/weighting.py).
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"reduce_batch(x, op={op!r}): op is 'mean' or 'sum'")
    if weight is not None and op != "mean":
        raise ValueError(f"reduce_batch(x, op={op!r}, weight=...): a weight is for op='mean' only")
    fn = getattr(active_handler(), "reduce_batch", None)
    if fn is not None:
        return fn(x, op, weight)
    if weight is None:
        return x
    from meshlm.core import weighting

    return weighting.attach(x.view_as(x), weight)


def dropout(x: Tensor, p: float, axes: Axes, training: bool = True) -> Tensor:
    """Dropout of activation ``x`` (logical ``axes``, one per dim, as for ``constrain``):
    zero each element with probability ``p``, scale the rest by ``1 / (1 - p)``.

    The mask is a function of a key drawn from torch's global generator and of each
    element's index in the global tensor, so every layout draws exactly the one-device
    mask: data-parallel ranks drop different elements of their different rows, the ranks
    of a tensor-parallel group the same elements of a replicated activation (NOTE
    [dropout keys] in meshlm/core/rng.py).  With ``training=False`` (pass ``self.training``)
    or ``p == 0`` it returns ``x`` and draws nothing.  Use it instead of ``F.dropout``,
    which is not layout-exact."""
    from meshlm.core import rng

    rng._check_p(p)
    if not training or p == 0.0:
        return x
    key = rng.draw_key()
    fn = getattr(active_handler(), "dropout", None)
    return rng.dropout_plain(x, p, axes, key) if fn is None else fn(x, p, axes, key)


def block(cls: type) -> type:
    """Class decorator: this module is a block, the unit of per-block torch.compile,
    activation checkpointing and parameter re-gathering in backward."""
    cls.__meshlm_block__ = True
    return cls


def is_block(m: nn.Module) -> bool:
    return bool(getattr(type(m), "__meshlm_block__", False))


def outer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks (``@block``) not nested in another block, in module order."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not is_block(m):
            continue
        out.append(m)
        inside.update(id(s) for s in m.modules())
    return out


def param_axes_of(m: nn.Module) -> dict[str, Axes]:
    """The ``param_axes`` a module declares: merged along its class hierarchy, then its
    instance attribute ``param_axes`` (``set_axes``), which wins."""
    out: dict[str, Axes] = {}
    for klass in reversed(type(m).__mro__):
        out.update(getattr(klass, "__dict__", {}).get("param_axes", {}) or {})
    out.update(m.__dict__.get("param_axes", {}) or {})
    return out


def set_axes(module: nn.Module, **axes: Axes) -> nn.Module:
    """Annotate ``module``'s own parameters on this instance only, e.g.
    ``set_axes(model.lm_head, weight=("vocab", "embed"))``: one logical axis (or None) per
    dim of the parameter as stored (torch's ``nn.Linear.weight`` is ``(out, in)``).  Works on
    any module, torch's own included; overrides the class's ``param_axes`` for these names.
    Returns ``module``."""
    from meshlm.core.errors import AnnotationError

    own = {n: p for n, p in module._parameters.items() if p is not None}
    mine = dict(module.__dict__.get("param_axes", {}) or {})  # a copy: never the class's dict
    for name, ax in axes.items():
        if name not in own:
            raise AnnotationError(
                f"set_axes({type(module).__name__}, {name}=...): {type(module).__name__} has no parameter "
                f"{name!r}; its own parameters are {', '.join(own) or 'none'} (annotate a submodule's "
                "parameters on that submodule)"
            )
        ax = (ax,) if isinstance(ax, str) or ax is None else tuple(ax)
        if len(ax) != own[name].ndim:
            raise AnnotationError(
                f"set_axes({type(module).__name__}, {name}={ax}): parameter {name!r} has {own[name].ndim} dims "
                f"{tuple(own[name].shape)}; give one logical axis (or None) per dim, in the order it is stored"
            )
        mine[name] = ax
    module.param_axes = mine
    return module


def declare_axes(module: nn.Module, **descriptions: str) -> nn.Module:
    """Declare new logical axes on ``module`` (NOTE [open vocabulary] in meshlm/core/axes.py),
    e.g. ``declare_axes(model, codebook="entries of the VQ codebook")``: the model's
    parameters, constraints and layouts may then name them.  Returns ``module``."""
    mine = dict(module.__dict__.get("logical_axes", {}) or {})
    mine.update(descriptions)
    module.logical_axes = mine
    return module


def init_params(root: nn.Module, seed: int) -> None:
    """The canonical initialisation: one generator seeded with ``seed``, and each module's
    ``init_weights(generator)`` (which fills that module's *own* parameters and buffers, not
    its children's) called in ``root.modules()`` order.  The lowering replays exactly this
    order shard by shard, so a sharded model initialised from a seed equals the one-device
    model of the same seed.  The draws are made on float32 CPU stand-ins (init_module), so
    the weights of a seed are the same, up to rounding, in any dtype and on any device."""
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()  # a tied parameter keeps its first owner's draw (NOTE [ties] in meshlm/core/ties.py)
    for m in root.modules():
        own = [(n, p) for n, p in m._parameters.items() if p is not None]
        drawn = init_module(m, gen, own)
        with torch.no_grad():
            for n, t in drawn.items():
                if n in m._buffers:  # NOTE [buffers] in meshlm/runtime/lowering/buffers.py
                    m._buffers[n].copy_(t)
                elif id(m._parameters[n]) not in done:
                    m._parameters[n].copy_(t)
        done.update(id(p) for _n, p in own)


def init_module(m: nn.Module, gen: torch.Generator, own: list) -> dict[str, Tensor]:
    """``m.init_weights(gen)`` run on CPU stand-ins for the parameters ``own`` (name,
    parameter) and the buffers of ``m``, float32 for the narrower float dtypes; returns the
    parameters' stand-ins and those of the buffers it filled, by name ({} if ``m`` has no
    init_weights; NOTE [buffers] in meshlm/runtime/lowering/buffers.py).  Why float32: torch's random
    kernels draw a different stream per dtype (and the bf16 one changed between torch 2.11
    and 2.13), so drawing in the storage dtype would make the weights of a seed depend on
    the dtype and the torch version; drawn in float32 and rounded, they depend on neither."""
    fn = getattr(m, "init_weights", None)
    if not callable(fn):
        return {}
    saved, saved_bufs = dict(m._parameters), dict(m._buffers)
    stand: dict[str, tuple[int, int]] = {}  # each buffer stand-in's identity and version: filled if changed
    try:
        for n, p in own:
            m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=_draw_dtype(p)), requires_grad=p.requires_grad)
        for n, b in saved_bufs.items():
            if b is not None:
                m._buffers[n] = torch.empty(b.shape, dtype=_draw_dtype(b))
                stand[n] = (id(m._buffers[n]), m._buffers[n]._version)
        with torch.no_grad():
            fn(gen)
        out = {n: m._parameters[n].data for n, _ in own}
        for n, was in stand.items():
            b = m._buffers.get(n)
            if b is not None and (id(b), b._version) != was:
                out[n] = b
        return out
    finally:
        m._parameters.update(saved)
        m._buffers.update(saved_bufs)


def _draw_dtype(t: Tensor) -> torch.dtype:
    return torch.float32 if t.dtype.is_floating_point and t.dtype.itemsize < 4 else t.dtype
