"""Public names that load from their home modules on first use (PEP 562), for a package
whose import must stay light (``meshlm``, ``meshlm.models``, ``meshlm.train.checkpoint``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, namespace: dict[str, Any], homes: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``, whose module globals are ``namespace``:
    ``homes`` maps each public name to the module that defines it, or to ``"module:attr"``
    where the home calls it otherwise; a name whose home is ``package.name`` is that module.
    A loaded value is kept in ``namespace``, so each name loads once."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attr = home.partition(":")
        module = importlib.import_module(module_name)
        value = module if module_name == f"{package}.{name}" else getattr(module, attr or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
