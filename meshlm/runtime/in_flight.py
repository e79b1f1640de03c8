"""A sharded model's gradient reductions still in flight when a block's backward returns
(NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py), waited for when the backward
pass ends.

Per-model state (NOTE [run state] in meshlm/core/state.py): each sharded model owns one
``InFlight`` (``ShardState.in_flight``) and each of its parameters names it (``own``), so
the backward of one model never settles, nor waits on, another's; it is empty between
backward passes.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.errors import MeshlmError

ATTR = "_meshlm_in_flight"  # on each parameter of a sharded model: its model's InFlight


class InFlight:
    """The reductions of one model left in flight in the backward pass running now."""

    def __init__(self) -> None:
        self.grads: list[Tensor] = []  # parameters whose ``.grad`` is still in flight
        self.mains: list[tuple] = []  # (parameter, reduced gradient in flight, dtype): NOTE [main grads]

    def __len__(self) -> int:
        return len(self.grads) + len(self.mains)

    def later(self, entries: list, item, settle: Callable[["InFlight"], None]) -> None:
        """Add ``item`` to ``entries`` (``self.grads`` or ``self.mains``); the first entry of
        a backward pass queues ``settle(self)`` for its end."""
        if not entries:
            compat.queue_backward_callback(lambda: settle(self))
        entries.append(item)


def own(params, in_flight: InFlight) -> None:
    """Make ``in_flight`` where the gradients of ``params`` in flight wait."""
    for p in params:
        setattr(p, ATTR, in_flight)


def of(p: Tensor) -> InFlight:
    """The InFlight of the model ``p`` belongs to."""
    got = getattr(p, ATTR, None)
    if got is None:
        raise MeshlmError(
            f"a gradient of a parameter of shape {tuple(p.shape)} was left in flight, but the parameter belongs to "
            "no sharded model (meshlm.shard makes each of its parameters name its model's in-flight reductions); "
            "shard the model that owns it, or pass overlap=False"
        )
    return got
