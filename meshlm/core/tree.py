"""Walking the inputs and outputs of a model: every tensor leaf, with its path.

A model's ``forward`` may take and return tensors inside containers: dicts (and other
mappings), lists, tuples, named tuples and dataclass instances, nested to any depth.  The
lowering treats every tensor leaf by the input rules (and lifts every output leaf), so it
must see them all; an object it cannot look inside that holds tensors is an error, never a
tensor silently left out (which would run as if replicated: each rank's slice taken for the
whole batch).  The exception is an object whose class sets ``__meshlm_passthrough__ = True``
(meshlm's KV cache, NOTE [KV cache] in meshlm/infer/cache.py): it places its own tensors,
and is handed to the forward as it is.

A leaf's *path* names it from the argument (or the output) down: ``batch.tokens`` for
``forward(batch={"tokens": t})``, ``inputs.1`` for the second item of a tuple argument,
``loss`` for the ``"loss"`` entry of a returned dict, and ``""`` for an output that is a
tensor itself.  Models declare a leaf's logical axes by this path (``input_axes``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from torch import Tensor

from meshlm.core.errors import AnnotationError


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _children(x: Any) -> "Iterator[tuple[Any, Any]] | None":
    """(key, child) pairs of a container meshlm looks inside, or None for a leaf."""
    if isinstance(x, Mapping):
        return iter(list(x.items()))
    if isinstance(x, (list, tuple)):
        return iter(list(enumerate(x)))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return iter([(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)])
    return None


def _rebuild(x: Any, items: list[tuple[Any, Any]]) -> Any:
    if isinstance(x, Mapping):
        out = copy.copy(x)
        for k, v in items:
            out[k] = v
        return out
    if _is_namedtuple(x):
        return type(x)(*[v for _k, v in items])
    if isinstance(x, tuple):
        return tuple(v for _k, v in items)
    if isinstance(x, list):
        out = copy.copy(x)
        out[:] = [v for _k, v in items]
        return out
    out = copy.copy(x)  # a dataclass instance (frozen ones too)
    for k, v in items:
        object.__setattr__(out, k, v)
    return out


def _holds_tensor(x: Any, depth: int = 3) -> bool:
    """Whether an object meshlm does not look inside keeps a tensor in its attributes."""
    if depth < 0 or getattr(type(x), "__meshlm_passthrough__", False):
        return False
    if isinstance(x, Tensor):
        return True
    kids = _children(x)
    if kids is not None:
        return any(_holds_tensor(v, depth - 1) for _k, v in kids)
    attrs = getattr(x, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(x, type):
        return any(_holds_tensor(v, depth - 1) for v in attrs.values())
    return False


def map_tensors(
    x: Any, fn: Callable[[str, Tensor], Any], path: str = "", *, strict: bool = True, what: str = "input"
) -> Any:
    """``x`` with every tensor leaf ``t`` at ``path`` replaced by ``fn(path, t)``; containers
    are rebuilt only where a leaf changed.  ``strict``: an object meshlm cannot look inside
    that holds tensors raises :class:`AnnotationError` naming its path."""
    if isinstance(x, Tensor):
        return fn(path, x)
    kids = _children(x)
    if kids is None:
        if strict and _holds_tensor(x):
            raise AnnotationError(
                f"{what} `{path or '(the whole ' + what + ')'}` is a {type(x).__name__} holding tensors, which "
                "meshlm cannot look inside, so it cannot shard them: pass tensors directly or inside a dict, "
                "list, tuple, named tuple or dataclass"
            )
        return x
    items, changed = [], False
    for k, v in kids:
        nv = map_tensors(v, fn, join(path, k), strict=strict, what=what)
        changed |= nv is not v
        items.append((k, nv))
    return _rebuild(x, items) if changed else x


def tensor_leaves(x: Any, path: str = "", *, what: str = "input") -> list[tuple[str, Tensor]]:
    """(path, tensor) of every tensor leaf of ``x``, in order (strict, as ``map_tensors``)."""
    out: list[tuple[str, Tensor]] = []

    def visit(p: str, t: Tensor) -> Tensor:
        out.append((p, t))
        return t

    map_tensors(x, visit, path, what=what)
    return out


def leaves(x: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf of ``x``, tensors and anything else meshlm does not look
    inside (numbers, strings, None, other objects)."""
    kids = None if isinstance(x, Tensor) else _children(x)
    if kids is None:
        return [(path, x)]
    out: list[tuple[str, Any]] = []
    for k, v in kids:
        out.extend(leaves(v, join(path, k)))
    return out
