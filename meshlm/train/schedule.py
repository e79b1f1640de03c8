"""The learning-rate schedules of ``meshlm train``: ``cosine``, ``linear``, ``constant`` and
``wsd`` (warmup-stable-decay), each after a linear warmup.

NOTE [lr schedules]
    ``lr_at(step, t)`` is the learning rate of global step ``step`` (counted from 1), a pure
    function of the step and the ``train`` section, so a resumed run takes the same rates
    as one that never stopped.  The warmup rises linearly, ``lr * step / warmup_steps``,
    reaching ``lr`` at step ``warmup_steps``.  After it, with ``f`` the fraction of the
    remaining steps done (0 at the warmup's last step, 1 at ``steps``):

    - ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * f)) / 2``;
    - ``linear``: ``lr - (lr - min_lr) * f``;
    - ``constant``: ``lr``;
    - ``wsd``: ``lr`` until the last ``decay_frac`` of the steps (the decay starts at step
      ``steps - round(decay_frac * steps)``, never before the warmup ends), then linear to
      ``min_lr`` at ``steps``.

    Each is the schedule torch's ``lr_scheduler`` classes give chained behind a
    ``LinearLR`` warmup (``SequentialLR``), step ``s`` here being their epoch ``s``
    (tests/unit/test_schedule.py checks each against them).
"""

from __future__ import annotations

import math
from typing import Protocol

SCHEDULES = ("cosine", "linear", "constant", "wsd")


class Schedule(Protocol):
    """The schedule's fields (the app's ``train`` config section has them)."""

    lr: float
    min_lr: float
    warmup_steps: int
    steps: int
    schedule: str
    decay_frac: float


def decay_start(t: Schedule) -> int:
    """The step after which ``wsd`` decays (NOTE [lr schedules])."""
    return max(t.warmup_steps, t.steps - round(t.decay_frac * t.steps))


def lr_at(step: int, t: Schedule) -> float:
    """The learning rate of global step ``step`` (from 1) under ``t`` (NOTE [lr schedules])."""
    kind = getattr(t, "schedule", "cosine")
    if kind not in SCHEDULES:
        raise ValueError(f"train.schedule={kind!r}: choose one of {', '.join(SCHEDULES)}")
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if kind == "constant":
        return t.lr
    if kind == "wsd":
        start = decay_start(t)
        if step <= start:
            return t.lr
        frac = min(1.0, (step - start) / max(1, t.steps - start))
        return t.lr - (t.lr - t.min_lr) * frac
    frac = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    if kind == "linear":
        return t.lr - (t.lr - t.min_lr) * frac
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * frac))
