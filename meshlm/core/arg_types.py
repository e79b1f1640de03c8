"""A config value against the type its parameter or dataclass field declares.

NOTE [argument types]
    A model node's keys are keyword arguments of its ``_target_`` (NOTE [model node] in
    meshlm/models/node.py), and YAML or the command line hand them over as whatever they
    parse to: ``model.embed=big`` is the string ``'big'``, which the target would carry to
    ``torch.empty`` and a traceback deep inside it.  So each value is checked, before any
    process starts, against what the target declares for it: its annotation
    (``typing.get_type_hints``, so PEP 563 strings resolve), else a number default (an
    unannotated ``width=64`` takes a number).  Only the types a config value can take are
    checked: ``int`` (not ``bool``), ``float`` (an int is a float), ``bool``, ``str``,
    ``Literal``, lists and tuples (and their items), mappings, and ``Optional``/``Union``
    of these.  A null is never refused here (the target decides what null means); neither
    is anything whose annotation names another type (a class, ``Any``, a name that does not
    resolve), so the check never refuses a value the target would take.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Literal, Optional

from meshlm.core.errors import ConfigError

_EMPTY = inspect.Parameter.empty
_NUMBER = "number"  # an unannotated parameter with a number default: any int or float
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _accepts(value: Any, hint: Any) -> Optional[bool]:
    """Whether ``value`` is a ``hint``; None when ``hint`` is not a type checked here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        found = [_accepts(value, a) for a in args]
        return True if any(found) else None if None in found else False
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    base = origin or hint
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is str:
        return isinstance(value, str)
    if base in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args and (base is not tuple or (len(args) == 2 and args[1] is ...)) else None
        return item is None or not any(_accepts(v, item) is False for v in value)
    if base in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping)
    return None


def _describe(hint: Any) -> str:
    """``hint`` as the kind of value to write: "an integer", "true or false", ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" (or null)" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    base = origin or hint
    if base in (list, tuple, collections.abc.Sequence) and args and (base is not tuple or args[1:] == (...,)):
        return "a list of " + {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
            args[0], _describe(args[0])
        )
    names = {
        _NUMBER: "a number",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        collections.abc.Sequence: "a list",
        dict: "a mapping",
        collections.abc.Mapping: "a mapping",
    }
    return names.get(base, getattr(base, "__name__", str(base)))


def _hint_name(hint: Any) -> str:
    if hint == _NUMBER:
        return "unannotated"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def check_value(key: str, value: Any, hint: Any, default: Any = _EMPTY, owner: str = "") -> None:
    """Raise ConfigError naming ``key`` if ``value`` is not of type ``hint``; a null, or a
    ``hint`` that is not a type checked here (NOTE [argument types]), passes."""
    if value is None or hint is None or _accepts(value, hint) is not False:
        return
    name = key.rsplit(".", 1)[-1]
    decl = f"{owner}'s {name} is {_hint_name(hint)}" if owner else f"{name} is {_hint_name(hint)}"
    example = ""
    if default is not _EMPTY and default is not None and default is not dataclasses.MISSING:
        decl += f", default {default!r}" if hint != _NUMBER else f" with the default {default!r}"
        if _accepts(default, hint) and isinstance(default, (bool, int, float)):
            example = f", e.g. {key}={str(default).lower() if isinstance(default, bool) else default}"
    raise ConfigError(f"{key}={value!r} is not {_describe(hint)} ({decl}); give {key} {_describe(hint)}{example}")


def _resolve(hint: Any, globalns: dict) -> Any:
    """A string annotation evaluated in its module, or None where it does not evaluate (a
    name imported under TYPE_CHECKING only, syntax newer than this Python)."""
    for _ in range(2):  # a quoted annotation under PEP 563 is a string of a string
        if not isinstance(hint, str):
            return hint
        try:
            hint = eval(hint, dict(globalns))  # noqa: S307 - what typing.get_type_hints does too
        except Exception:  # noqa: BLE001 - an annotation we cannot read is not checked
            return None
    return None if isinstance(hint, str) else hint


def parameter_types(fn: Callable, sig: inspect.Signature) -> dict[str, tuple[Any, Any]]:
    """``{name: (hint, default)}`` for the keyword parameters of ``fn`` (signature ``sig``):
    its annotation, else ``_NUMBER`` for a number default, else None (unchecked)."""
    target = inspect.unwrap(fn.__init__ if inspect.isclass(fn) else fn)
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - one unreadable annotation: read the others one by one
        hints = {}
    globalns = getattr(target, "__globals__", {})
    out = {}
    for name, p in sig.parameters.items():
        if p.kind not in _KEYWORD:
            continue
        if p.annotation is not _EMPTY:  # an annotation that does not resolve: unchecked
            hint = hints.get(name, _resolve(p.annotation, globalns))
        elif isinstance(p.default, (int, float)):  # bool too: True is an int
            hint = bool if isinstance(p.default, bool) else _NUMBER
        else:
            hint = None
        out[name] = (hint, p.default)
    return out


def check_fields(cls: type, values: dict[str, Any], owner: str, prefix: str = "model.") -> None:
    """Check ``values`` against the fields of dataclass ``cls`` (those it has: unknown keys
    are the caller's to report), naming ``prefix + field``."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - see parameter_types
        return
    for f in dataclasses.fields(cls):
        if f.name in values:
            check_value(prefix + f.name, values[f.name], hints.get(f.name), f.default, owner)
