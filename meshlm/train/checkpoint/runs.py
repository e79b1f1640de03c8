"""Which run a checkpoint directory belongs to (checkpoint.py).

NOTE [one run per checkpoint directory]
    Every run that saves checkpoints has a run id (``20261201-061502-3f9a1c``: start time
    and six random hex digits).  It is written in ``<dir>/run.json`` when the run claims the
    directory and in the ``meta.json`` of each of its checkpoints (``run_id``).  A resumed
    run takes the id of the checkpoint it resumes from, so a run keeps its id across
    preemptions, crashes and changes of layout or mesh.

    * A fresh run (``checkpoint.resume=null``) into a directory that already holds
      checkpoints, or another run's ``run.json``, stops before training with a
      :class:`CheckpointError` naming the directory, the run that owns it and the fix
      (``checkpoint.resume=auto`` to continue that run, or another ``checkpoint.dir``).
    * A resume whose checkpoint directory is owned by another run, or holds checkpoints of
      this run *newer* than the one resumed from (they would be replaced by the new
      timeline), stops the same way.
    * Retention (``checkpoint.keep``) deletes only the current run's own checkpoints, and a
      save never replaces a complete checkpoint: a ``step_<N>`` that exists is an error.

    Checkpoints written before run ids existed have none: they block a fresh run like any
    other, a resume from them starts a new id, and retention never deletes them.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Optional

from meshlm.core.errors import CheckpointError

RUN_FILE = "run.json"


def new_run_id() -> str:
    """A fresh run id: UTC start time and six random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def dir_owner(root: str) -> Optional[str]:
    """The run id in ``<root>/run.json``, or None (no file, or unreadable)."""
    try:
        with open(os.path.join(root, RUN_FILE)) as f:
            return str(json.load(f)["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_run_id(path: str) -> Optional[str]:
    """The ``run_id`` in a checkpoint's meta.json (None: none recorded, or unreadable)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            rid = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return None if rid is None else str(rid)


def _steps(cps: list[tuple[int, str]]) -> str:
    s = [str(n) for n, _ in cps]
    return ", ".join(s[:6] + (["..."] if len(s) > 6 else []))


def check_fresh(root: str, checkpoints: list[tuple[int, str]]) -> None:
    """A fresh run may save into ``root`` only when no run owns it yet (raises)."""
    owner = dir_owner(root)
    if not checkpoints and owner is None:
        return
    ids = sorted({checkpoint_run_id(p) or "unknown (no run id)" for _s, p in checkpoints} | ({owner} - {None}))
    what = (
        f"checkpoints of run {', '.join(ids)} (steps {_steps(checkpoints)})"
        if checkpoints
        else f"the run.json of run {owner} (no checkpoint saved yet)"
    )
    raise CheckpointError(
        f"checkpoint.dir={root!r} holds {what}, and this run starts fresh (checkpoint.resume=null): saving into "
        "it would mix two runs. To continue that run set checkpoint.resume=auto; to start a new run choose "
        "another checkpoint.dir (or delete the old one)"
    )


def check_resume(root: str, checkpoints: list[tuple[int, str]], run_id: Optional[str], step: int) -> None:
    """A run with id ``run_id`` resuming at ``step`` may save into ``root`` (raises)."""
    owner = dir_owner(root)
    others = sorted(
        {r for r in (checkpoint_run_id(p) for _s, p in checkpoints) if r and r != run_id} | ({owner} - {None, run_id})
    )
    if others:
        raise CheckpointError(
            f"checkpoint.dir={root!r} belongs to run {', '.join(others)}, but the checkpoint resumed from is of run "
            f"{run_id or 'unknown (no run id)'}: saving there would mix two runs. Set checkpoint.dir to the "
            "directory of the checkpoint you resume (or checkpoint.resume=auto), or to a new directory"
        )
    newer = [(s, p) for s, p in checkpoints if s > step and checkpoint_run_id(p) == run_id and run_id]
    if newer:
        raise CheckpointError(
            f"checkpoint.dir={root!r} holds later checkpoints of the same run (steps {_steps(newer)}) than the one "
            f"resumed from (step {step}); continuing from step {step} would replace them. To continue from the "
            "newest checkpoint that checks out, set checkpoint.resume=auto (it skips damaged ones and sets them "
            f"aside); to branch from step {step}, keep checkpoint.resume and set checkpoint.dir to a new directory; "
            f"to drop the later ones, move {', '.join(os.path.basename(p) for _s, p in newer)} out of {root}"
        )


def claim(root: str, run_id: str) -> None:
    """Write ``<root>/run.json`` naming ``run_id`` (rank 0; atomic)."""
    os.makedirs(root, exist_ok=True)
    f = os.path.join(root, RUN_FILE)
    if dir_owner(root) == run_id:
        return
    tmp = f + ".part"
    with open(tmp, "w") as fh:
        json.dump({"run_id": run_id, "claimed": time.time()}, fh)
        fh.write("\n")
    os.replace(tmp, f)


def own(checkpoints: list[tuple[int, str]], run_id: Optional[str]) -> list[tuple[int, str]]:
    """The checkpoints of run ``run_id`` (``None``: those without a run id): retention's candidates."""
    return [(s, p) for s, p in checkpoints if checkpoint_run_id(p) == run_id]
