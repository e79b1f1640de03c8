"""Where each kind of training state lives: the ``offload`` section of a layout, or the
``offload.*`` settings of a run (NOTE [offload tiers] in meshlm/runtime/offload/__init__.py).

A layout may carry an ``offload`` section mapping a kind of state to a tier::

    offload:
      optimizer: disk      # optimizer state and master weights
      activations: host    # tensors autograd saves for backward

and the run's ``offload.<kind>=<tier>`` settings override it kind by kind, so an offload
composes with any layout from the command line.  ``resolve_offload`` merges the two and
checks every value.  What a given layout cannot offload is refused where it is known,
before any training step, naming the key (meshlm.runtime.offload.runtime.open_offload, the
optimizer's offloads: meshlm/runtime/offload/optimizer.py, grads.py, params.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

from meshlm.core.errors import ConfigError

TIERS = ("device", "host", "disk")
#: kind of state -> what it is (for messages and docs)
KINDS = {
    "optimizer": "optimizer state and master weights (the step runs where they live)",
    "grads": "gradients, from backward (each as autograd stores it) to the step",
    "params": "parameters between uses",
    "activations": "activations saved for backward",
}


@dataclass(frozen=True)
class OffloadSpec:
    """A tier per kind of state; ``dir``: where the disk tier writes (default: the run
    directory's ``offload/``)."""

    optimizer: str = "device"
    grads: str = "device"
    params: str = "device"
    activations: str = "device"
    dir: Optional[str] = None

    @property
    def active(self) -> bool:
        return any(getattr(self, k) != "device" for k in KINDS)

    @property
    def uses_disk(self) -> bool:
        return any(getattr(self, k) == "disk" for k in KINDS)

    def label(self) -> str:
        """``optimizer=disk,activations=host`` (or ``none``)."""
        return ",".join(f"{k}={getattr(self, k)}" for k in KINDS if getattr(self, k) != "device") or "none"


def parse_offload(data: Any, where: str, error: type = ConfigError) -> OffloadSpec:
    """An ``offload`` mapping (a layout section, or the run's settings) checked: known kinds,
    known tiers; ``where`` names it in errors, raised as ``error``."""
    if data is None:
        return OffloadSpec()
    if not isinstance(data, Mapping):
        raise error(f"{where}: an offload section maps kinds of state ({', '.join(KINDS)}) to a tier; got {data!r}")
    allowed = (*KINDS, "dir")
    for k, v in data.items():
        if k not in allowed:
            raise error(f"{where}.{k}: not a kind of state; offload takes {', '.join(allowed)}")
        if k == "dir":
            if v is not None and not isinstance(v, str):
                raise error(f"{where}.dir={v!r}: a directory path")
        elif v is not None and v not in TIERS:
            raise error(f"{where}.{k}={v!r} is not a tier; choose one of: {', '.join(TIERS)}")
    return OffloadSpec(**{k: v for k, v in data.items() if v is not None})


def resolve_offload(layout_section: Optional[OffloadSpec], overrides: Mapping[str, Any]) -> OffloadSpec:
    """The layout's offload section with the run's settings (``None``: not set) on top
    (``check_supported`` is the caller's: meshlm.app.config.offload_spec)."""
    base = layout_section or OffloadSpec()
    given = parse_offload({k: v for k, v in overrides.items() if v is not None}, "offload")
    changes = {
        f.name: getattr(given, f.name)
        for f in fields(OffloadSpec)
        if f.name in overrides and overrides[f.name] is not None
    }
    return replace(base, **changes)
