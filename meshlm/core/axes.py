"""The logical-axis vocabulary.

A logical axis names the *role* of a tensor dim (``embed``, ``heads``, ...); a mesh axis
names a dim of the device mesh (``dp``, ``fsdp``, ``tp``, ...).  Models speak only
logical axes; layouts map logical axes to mesh axes.

NOTE [open vocabulary]
    Mesh axes are a closed list.  Logical axes are open, but never implicit: the axes a
    model may use are meshlm's standard ones (``LOGICAL_AXES``, which the shipped layouts
    name) plus those its modules *declare* in a ``logical_axes`` attribute (class or
    instance; ``{"codebook": "entries of the VQ codebook"}`` or a tuple of names;
    ``meshlm.declare_axes``).  Every name a parameter annotation, a ``constrain``, an
    ``input_axes`` entry or a layout key uses must be one of those, so a typo on either
    side (``embd`` in a model, ``codebok`` in a layout) is an error that suggests the
    closest known name, never a silently replicated tensor.  A layout may name standard
    axes a model does not use (``kv_heads`` for a model without grouped-query attention):
    that is how one layout serves every model.  Parameter axes and layout keys are checked
    when the layout meets the model (``plan_params``, so ``meshlm.shard`` and ``meshlm
    layout show``); ``constrain`` and input axes when the sharded model runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from torch import nn

Axes = Tuple[Optional[str], ...]
"""One entry per tensor dim: a logical axis name, or ``None`` for "never sharded"."""

LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a global batch",
    "seq": "token positions (queries)",
    "kv_seq": "key/value positions (same size as seq, different role)",
    "embed": "model width (hidden size)",
    "mlp": "feed-forward intermediate width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (grouped-query attention)",
    "head_dim": "width of one attention head",
    "vocab": "token vocabulary",
    "layers": "stacked transformer layers",
    "experts": "mixture-of-experts experts",
    "channels": "image or audio channels",
    "patch": "image patches / audio frames",
}
"""The standard logical axes (the names the shipped layouts use), each with what it names; a
model adds its own (NOTE [open vocabulary])."""

MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "cp", "pp", "ep")
"""Mesh axes in canonical outer -> inner order.  Rank order is row-major in this order,
so the innermost (fastest varying) axis is ``ep``, then ``pp`` ... and ``dp`` outermost."""

#: Mesh axes over which the batch is split (ranks that differ only in other axes see the
#: same examples).
DATA_AXES: tuple[str, ...] = ("dp", "fsdp")


def closest(name: str, known: Iterable[str], n: int = 1) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name`` (``'x' or 'y'``: the
    ``n`` closest), or ``""``."""
    near = difflib.get_close_matches(name, list(known), n=n, cutoff=0.6)
    return did_you_mean(near)


def did_you_mean(names: Sequence[str]) -> str:
    """`` (did you mean 'x' or 'y'?)``, or ``""`` for no names."""
    if not names:
        return ""
    quoted = [repr(x) for x in names]
    return f" (did you mean {' or '.join([', '.join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)}?)"


def check_logical(name: str, where: str, known: Optional[Collection[str]] = None) -> None:
    """Raise :class:`meshlm.core.errors.AxisError` unless ``name`` is a logical axis:
    a standard one, or one of ``known`` (a model's vocabulary, NOTE [open vocabulary])."""
    from meshlm.core.errors import AxisError

    if not isinstance(name, str) or not name:
        raise AxisError(f"{where}: a logical axis is a non-empty string (or None), got {name!r}")
    if name in LOGICAL_AXES or (known is not None and name in known):
        return
    names = dict.fromkeys([*LOGICAL_AXES, *(known or ())])
    raise AxisError(
        f"{where}: unknown logical axis {name!r}{closest(name, names)}. Known logical axes: "
        f"{', '.join(names)}. Fix the spelling, or, if the model needs a new role, declare it on "
        f'a module of the model: `logical_axes = {{{name!r}: "what it is"}}` (or '
        f'`meshlm.declare_axes(module, {name}="...")`); NOTE [open vocabulary] in meshlm/core/axes.py.'
    )


def declared_axes(m: "nn.Module") -> dict[str, str]:
    """The logical axes module ``m`` itself declares (``logical_axes``: a dict name ->
    description or a sequence of names; its class hierarchy's, then the instance's)."""
    from meshlm.core.errors import AxisError

    out: dict[str, str] = {}
    sources = [getattr(k, "__dict__", {}).get("logical_axes") for k in reversed(type(m).__mro__)]
    for src in [*sources, m.__dict__.get("logical_axes")]:
        if not src:
            continue
        if isinstance(src, str) or not isinstance(src, (Mapping, Sequence)):
            raise AxisError(
                f"{type(m).__name__}.logical_axes = {src!r}: declare new logical axes as a dict "
                "{name: description} or a tuple of names"
            )
        items = src.items() if isinstance(src, Mapping) else ((n, "") for n in src)
        for n, doc in items:
            if not isinstance(n, str) or not n.isidentifier():
                raise AxisError(
                    f"{type(m).__name__}.logical_axes: {n!r} is not a valid axis name "
                    "(use an identifier such as 'codebook')"
                )
            out[n] = str(doc)
    return out


def vocabulary(model: "nn.Module") -> dict[str, str]:
    """Every logical axis ``model`` may use: the standard ones and those its modules
    declare (NOTE [open vocabulary]); name -> description."""
    out = dict(LOGICAL_AXES)
    for m in model.modules():
        for n, doc in declared_axes(m).items():
            out.setdefault(n, doc or f"declared by {type(m).__name__}")
    return out


def check_layout_keys(layout, known: Collection[str], model_name: str) -> None:
    """Every logical axis a layout maps must be known to the model (a typo in a layout is
    an error, NOTE [open vocabulary])."""
    from meshlm.core.errors import AxisError

    for sec in ("params", "compute", "grads", "optimizer"):
        rules = layout.rules(sec)
        for key in rules if isinstance(rules, Mapping) else ():
            if key not in known:
                custom = [n for n in known if n not in LOGICAL_AXES]
                raise AxisError(
                    f"{layout.source}: {sec}.{key}: the layout maps logical axis {key!r}{closest(key, known)}, "
                    f"which is neither a standard logical axis nor declared by model {model_name} (it declares "
                    f"{', '.join(custom) or 'none'}). Fix the spelling in the layout, or declare the axis on a "
                    f'module of the model (`logical_axes = {{{key!r}: "..."}}`; NOTE [open vocabulary] in '
                    "meshlm/core/axes.py)."
                )


def check_mesh(name: str, where: str) -> None:
    """Raise :class:`meshlm.core.errors.AxisError` unless ``name`` is a mesh axis."""
    from meshlm.core.errors import AxisError

    if name not in MESH_AXES:
        raise AxisError(f"{where}: unknown mesh axis {name!r}. Mesh axes are {', '.join(MESH_AXES)} (outer -> inner).")
