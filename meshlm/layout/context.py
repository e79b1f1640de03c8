"""How attention runs when a layout shards the sequence over the ``cp`` mesh axis: the
``context`` section of a layout (docs/cp.md)::

    context:
      attention: ring    # ring (keys and values passed around the cp group) | allgather
      balance: true      # causal load balancing: each rank holds a head and a tail chunk

Only a layout whose compute rules map ``seq`` to ``cp`` uses it; the defaults (ring,
balanced) are what a layout without the section gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlm.core.errors import ConfigError

ATTENTION = ("ring", "allgather")


@dataclass(frozen=True)
class ContextSpec:
    """``attention``: how keys and values reach every query (one of ``ATTENTION``);
    ``balance``: each cp rank holds sequence chunks r and 2n-1-r of 2n (NOTE [balanced
    chunks] in meshlm/_torch_compat/dtensor_cp.py), so causal attention costs every rank
    the same."""

    attention: str = "ring"
    balance: bool = True


def parse_context(data: Any, where: str, error: type = ConfigError) -> ContextSpec:
    """The ``context`` section checked; ``where`` names it in errors, raised as ``error``."""
    if data is None:
        return ContextSpec()
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping with keys attention, balance; got {data!r}")
    unknown = set(data) - {"attention", "balance"}
    if unknown:
        raise error(
            f"{where}: unknown key(s) {sorted(unknown)}; the keys are attention ({'|'.join(ATTENTION)}), balance"
        )
    att = data.get("attention", "ring")
    if att not in ATTENTION:
        raise error(f"{where}.attention: {att!r} is not one of {', '.join(ATTENTION)}")
    bal = data.get("balance", True)
    if not isinstance(bal, bool):
        raise error(f"{where}.balance: expected true or false, got {bal!r}")
    return ContextSpec(att, bal)
