"""The run state: what the code running now is doing, in one object (``RUN``), set only
through ``scope`` (and its two halves ``swap`` / ``restore``) and ``counting``.

NOTE [run state]
    What a sharded model needs at run time lives in one of three places
    (meshlm/runtime/state.py lists every module-level object of meshlm and says which):

    - per model, on objects the sharded model owns (its ``ShardState``, the ``Prefetch``
      and ``InFlight`` it holds, the optimizer): they die with the model, and two models
      in one process never see each other's;
    - here, the dynamic scopes: facts about the code running now, whichever model it
      belongs to (the constrain handler in effect, whether a parameter gather is running,
      the dropout rows of a local block, ...), each a field of ``RUN``;
    - process-wide tables that compiled graphs refer to by index, and caches
      (NOTE [process-wide tables] in meshlm/runtime/state.py).

    ``RUN`` is one plain object of the process, not a thread-local or a context variable,
    because code that torch.compile traces reads it (a block's ``constrain`` reads the
    handler, its parameter getters ``local_root``, its dropout ``rows``): Dynamo reads a
    plain object's attribute and guards on it, so a compiled block recompiles for another
    handler as it must.  Measured with torch 2.13 (fullgraph): ``ContextVar.get`` and
    ``threading.get_ident`` fail to trace, and a ``threading.local`` attribute is read at
    trace time and baked into the graph with no guard (the graph then ignores a later
    change: a wrong result, silently).  Autograd may also run backward on threads of its
    own, where a thread-local would read its defaults.  So the run state is the process's:
    meshlm runs a sharded model on one thread at a time (the training loop's, or the
    serving engine's), and a second thread running one concurrently would see the first's
    scopes.  The counters (``gathering``, ``local_root``) go up and down (``counting``)
    rather than being saved and restored, so that overlapping gathers on several threads
    (the unit tests' simulated ranks) still count right.

    It lives in ``core``, the lowest layer with a field (the constrain handler and the
    dropout rows); the fields of higher layers are typed loosely here and documented at
    their use.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from meshlm import _torch_compat as compat

# Every field of the run state and its value outside any scope.
DEFAULTS: dict[str, Any] = {
    # meshlm.core.annotate: the constrain handler of the sharded forward running now (the
    # lowering's; None: ``constrain`` is the identity).  Read in traced code.
    "handler": None,
    # meshlm.core.rng: this rank's (index, count) of the batch rows while a local block runs
    # (NOTE [dropout keys]).  Read and set in traced code.
    "rows": None,
    # meshlm.plan: the step running on fake tensors is the eager step (NOTE [fake eager]).
    "fake_eager": False,
    # meshlm.runtime.bucket / lowering.atuse: > 0 while a parameter gather runs (the
    # re-gathering checkpoint policy, lowering/policies.py, recomputes what runs meanwhile).
    "gathering": 0,
    # meshlm.runtime.lowering: > 0 while a root runs on local tensors (NOTE [local root]).
    # Read in traced code (the parameter getters).
    "local_root": 0,
    # meshlm.runtime.bucket.prefetch: (the model's Prefetch, block position) of the gather
    # about to run (NOTE [prefetch]; eager code only).
    "site": None,
    # meshlm.runtime.pipeline.stage: the StageRun of the stage forward running now (NOTE
    # [stage forward]; eager code only).
    "stage": None,
    # meshlm.runtime.absent: called with the leaves of every torch call on an Absent value
    # while the pipeline's probe runs (NOTE [absent values]).
    "on_use": None,
    # meshlm.core.annotate: functions called with every constrained tensor and its axes, after
    # the handler (``observing``; ``meshlm diff`` records activations through them).  Read in
    # traced code.
    "observers": (),
}


class RunState:
    """The fields of ``DEFAULTS``, one object for the process (NOTE [run state])."""

    __slots__ = tuple(DEFAULTS)

    handler: Optional[Callable]
    rows: Optional[tuple[int, int]]
    fake_eager: bool
    gathering: int
    local_root: int
    site: Any
    stage: Any
    on_use: Optional[Callable]
    observers: tuple

    def __init__(self) -> None:
        for name, value in DEFAULTS.items():
            setattr(self, name, value)

    def changed(self) -> dict[str, Any]:
        """The fields not at their default (outside every scope: none)."""
        return {n: getattr(self, n) for n, v in DEFAULTS.items() if getattr(self, n) is not v and getattr(self, n) != v}


RUN = RunState()


def _check(names) -> None:
    bad = [n for n in names if n not in DEFAULTS]
    if bad:
        raise TypeError(f"run state: no field {', '.join(map(repr, bad))}; the fields are {', '.join(DEFAULTS)}")


def swap(**values: Any) -> tuple:
    """Set run-state fields until ``restore`` is given what this returns (the first half of
    ``scope``, for a pair of hooks that enter and leave in separate calls)."""
    _check(values)
    saved = tuple((name, getattr(RUN, name)) for name in values)
    for name, value in values.items():
        setattr(RUN, name, value)
    return saved


def restore(saved: tuple) -> None:
    """Put back the fields a ``swap`` changed."""
    for name, value in saved:
        setattr(RUN, name, value)


class scope:
    """``with scope(handler=h):`` the run-state fields given are set inside the block and
    restored after it, also when it raises.  A class, not a generator: torch.compile traces
    it where a block's code enters one."""

    __slots__ = ("_values", "_saved")

    def __init__(self, **values: Any) -> None:
        _check(values)
        self._values = values
        self._saved: tuple = ()

    def __enter__(self) -> None:
        self._saved = swap(**self._values)

    def __exit__(self, *exc: Any) -> None:
        restore(self._saved)


class counting:
    """``with counting("gathering"):`` a counter field is one higher inside the block (by
    ``step``; 0 leaves it alone), and one lower after it."""

    __slots__ = ("_name", "_step")

    def __init__(self, name: str, step: int = 1) -> None:
        _check((name,))
        if not isinstance(DEFAULTS[name], int) or isinstance(DEFAULTS[name], bool):
            raise TypeError(f"run state: {name!r} is not a counter")
        self._name, self._step = name, step

    def __enter__(self) -> None:
        setattr(RUN, self._name, getattr(RUN, self._name) + self._step)

    def __exit__(self, *exc: Any) -> None:
        setattr(RUN, self._name, getattr(RUN, self._name) - self._step)


# NOTE [fake eager]: a fake tensor mode usually means torch.compile is tracing, but
# meshlm.plan's measurement (NOTE [fake measurement] in meshlm/plan/measure.py) runs the
# eager step on fake tensors and must take the eager paths (free and re-gather, prefetch,
# the local root) exactly as a real run does: it sets ``fake_eager`` for the step it measures.
def eager() -> bool:
    """Whether this code runs eagerly: not traced by Dynamo, nor by AOTAutograd on fake
    tensors (fake tensors under ``fake_eager`` run eagerly: NOTE [fake eager])."""
    if torch.compiler.is_compiling():
        return False
    return not compat.fake_mode_active() or RUN.fake_eager
