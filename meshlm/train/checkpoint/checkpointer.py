"""The Checkpointer: a run's checkpoints in one directory, saved every N steps, the newest
valid one resumed, the directory held by one run at a time (NOTE [one writer per checkpoint
directory] in meshlm/train/checkpoint/lock.py)."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from torch import nn

from meshlm.core.errors import CheckpointError
from meshlm.train.checkpoint import lock as _ckpt_lock
from meshlm.train.checkpoint import runs as _runs
from meshlm.train.checkpoint.config import CheckpointConfig, check_resume
from meshlm.train.checkpoint.files import (
    _bcast,
    _rank,
    list_checkpoints,
    read_meta,
    resolve_path,
)
from meshlm.train.checkpoint.load import check_checkpoint, load_checkpoint
from meshlm.train.checkpoint.save import _stderr, save_checkpoint


def lock_dir(root: str, run_dir: Optional[str] = None) -> Optional[_ckpt_lock.DirLock]:
    """Take ``root``'s lock on rank 0 (collective: every rank calls it, and every rank raises
    the same CheckpointError when another run holds it); rank 0's lock, None elsewhere
    (NOTE [one writer per checkpoint directory] in meshlm/train/checkpoint/lock.py)."""
    lock, err = None, None
    if _rank() == 0:
        try:
            lock = _ckpt_lock.acquire(root, run_dir)
        except CheckpointError as e:
            err = str(e)
    err = _bcast(err)
    if err:
        raise CheckpointError(err)
    return lock


# --------------------------------------------------------------------------- Checkpointer
class Checkpointer:
    """What the train loop talks to: ``resume()`` once, ``maybe_save(step, extra)`` every
    step, ``close()`` at the end.  ``cfg.dir=None`` disables saving.

    ``resume()`` also settles the run id (NOTE [one run per checkpoint directory] in
    _ckpt_runs.py): the resumed checkpoint's, or a new one, and claims ``cfg.dir`` for it;
    ``resumed`` is then the meta.json of the checkpoint resumed from (with its ``path``).

    It holds ``cfg.dir``'s lock from ``resume()`` (or the first save) to ``close()`` (NOTE
    [one writer per checkpoint directory] in _ckpt_lock.py); ``lock_note`` says, on rank 0,
    whose dead lock it took over (None when none).  ``run_dir`` is recorded in the lock."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        model: nn.Module,
        optimizer: Any = None,
        mesh: Any = None,
        run_meta: Optional[dict] = None,
        say: Callable[[str], None] = _stderr,
        run_dir: Optional[str] = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.lock: Optional[_ckpt_lock.DirLock] = None  # rank 0's
        self.locked = False  # on every rank: lock_dir ran
        self.lock_note: Optional[str] = None
        self.model = model
        self.optimizer = optimizer
        self.mesh = mesh
        self.run_meta = dict(run_meta or {})
        self.say = say
        self.last_saved: Optional[str] = None
        #: name -> path: files each save copies in beside the tensors (NOTE [run tokenizer] in assets.py)
        self.assets: dict[str, str] = {}
        self.run_id: Optional[str] = None
        self.resumed: Optional[dict] = None
        self.skipped: list[tuple[str, str, str]] = []  # (damaged checkpoint, why, where it was set aside)
        self._checked: Optional[str] = None  # the checkpoint check_checkpoint passed (auto)

    def _lock(self) -> None:
        """Take ``cfg.dir``'s lock (collective; once)."""
        if self.locked or not self.cfg.dir:
            return
        self.lock = lock_dir(self.cfg.dir, self.run_dir)
        self.locked = True
        self.lock_note = self.lock.took_over_line() if self.lock is not None else None

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
        self.lock, self.locked = None, False

    def _resume_path(self) -> Optional[str]:
        r = self.cfg.resume
        if r is None:
            return None
        check_resume(r)
        if r == "auto":
            if not self.cfg.dir:
                raise CheckpointError("checkpoint.resume=auto needs checkpoint.dir; set checkpoint.dir=PATH")
            return self._latest_valid(self.cfg.dir)
        return str(r)

    def _latest_valid(self, root: str) -> Optional[str]:
        """The newest checkpoint in ``root`` whose files check out (collective), setting the
        damaged newer ones aside (NOTE [damaged checkpoints]); None when there is none."""
        damaged: list[tuple[str, str]] = []
        for _step, path in reversed(_bcast(list_checkpoints(root) if _rank() == 0 else None)):
            why = check_checkpoint(path)
            if why is None:
                self._checked = path
                self._set_aside(damaged)
                return path
            damaged.append((path, why))
        if damaged:
            raise CheckpointError(
                f"checkpoint.resume=auto: every checkpoint in checkpoint.dir={root!r} is damaged ("
                + "; ".join(why for _p, why in damaged)
                + "). None was loaded. Resume one from a copy elsewhere (checkpoint.resume=PATH), or move them "
                "out of the directory to start afresh"
            )
        return None

    def _set_aside(self, damaged: list[tuple[str, str]]) -> None:
        """Rename each damaged ``step_<N>`` to ``step_<N>.damaged`` (rank 0), which no listing,
        resume or retention considers, and say so."""
        moved = None
        if _rank() == 0:
            moved = []
            for path, why in damaged:
                to, n = f"{path}.damaged", 1
                while os.path.exists(to):
                    n += 1
                    to = f"{path}.damaged{n}"
                try:
                    os.rename(path, to)
                except OSError as e:
                    to = f"not moved ({e.strerror})"
                moved.append((path, why, to))
                self.say(f"checkpoint.resume=auto: skipped {path}, set aside as {to}: {why}")
        self.skipped = _bcast(moved)

    def _settle_run(self, path: Optional[str]) -> tuple[str, Optional[dict]]:
        """(run id, meta of the checkpoint resumed from); rank 0 only; raises CheckpointError."""
        root = self.cfg.dir
        cps = list_checkpoints(root) if root else []
        meta = None
        if path is None:
            if root and self.cfg.resume is None:
                _runs.check_fresh(root, cps)
            rid = (_runs.dir_owner(root) if root else None) or _runs.new_run_id()
        else:
            path = resolve_path(path)
            meta = dict(read_meta(path), path=path)
            rid = meta.get("run_id") or _runs.new_run_id()
            if root:
                _runs.check_resume(root, cps, meta.get("run_id"), int(meta.get("step", 0)))
        if root:
            try:
                _runs.claim(root, rid)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint.dir={root!r}: cannot write {os.path.join(root, _runs.RUN_FILE)} ({e.strerror}); "
                    "set checkpoint.dir to a writable directory"
                ) from None
        return rid, meta

    def _settle(self, path: Optional[str]) -> None:
        """``_settle_run`` on rank 0, its outcome (or its error) on every rank."""
        out, err = (None, None), None
        if _rank() == 0:
            try:
                out = self._settle_run(path)
            except CheckpointError as e:
                err = str(e)
        (self.run_id, self.resumed), err = _bcast((out, err))
        if err:
            self._unlock()  # this run writes nothing: the next one finds the directory as it was
            raise CheckpointError(err)

    def resume(self) -> Optional[dict]:
        """Load the checkpoint ``cfg.resume`` names (``auto``: the latest complete one in
        ``cfg.dir``, None when there is none yet) and return its ``extra`` (with "step")."""
        if self.cfg.resume is not None:
            check_resume(self.cfg.resume)  # a misspelt value creates nothing (not even the lock)
        self._lock()
        try:
            path = self._resume_path()
            self._settle(path)
            if path is None:
                return None
            verified = path == self._checked  # checked just now (auto): not checksummed twice
            return load_checkpoint(path, model=self.model, optimizer=self.optimizer, verify=not verified)
        except BaseException:
            self._unlock()
            raise

    def maybe_save(self, step: int, extra: Optional[dict] = None) -> Optional[str]:
        """Save when ``cfg.every`` divides ``step``; return the directory or None."""
        if not self.cfg.dir or self.cfg.every <= 0 or step % self.cfg.every:
            return None
        return self.save(step, extra)

    def save(self, step: int, extra: Optional[dict] = None) -> str:
        """Save now (collective); keeps the last ``cfg.keep`` checkpoints of this run."""
        if not self.cfg.dir:
            raise CheckpointError("Checkpointer.save: checkpoint.dir is not set; set checkpoint.dir=PATH")
        extra = dict(extra or {})
        extra.setdefault("step", step)
        self._lock()
        if self.run_id is None:  # saved without resume(): a run of its own
            self._settle(None)
        self.last_saved = save_checkpoint(
            self.cfg.dir,
            step,
            model=self.model,
            optimizer=self.optimizer,
            extra=extra,
            run_meta=self.run_meta,
            keep=self.cfg.keep,
            run_id=self.run_id,
            assets=self.assets,
        )
        return self.last_saved

    def close(self) -> None:
        """Let go of ``cfg.dir``'s lock (nothing else is pending: saves are synchronous)."""
        self._unlock()
