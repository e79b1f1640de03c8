"""Sharded checkpoints that reshard on load and survive a SIGKILL at any moment.

A checkpoint is a directory ``<dir>/step_00000042/`` written with
``torch.distributed.checkpoint`` (DCP): every rank writes the shards it owns, and the
DCP metadata records each tensor's *global* shape and where its chunks lie.  Loading asks
DCP for the chunks the *loading* layout and mesh need, so a checkpoint saved under
``fsdp`` on 4 processes loads under ``fsdp_tp`` on 2x2, ``tp`` on 2 or a single process
with no conversion step.

What is saved (flat keys, so nothing depends on parameter order or rank count):

* ``model/<fqn>``: every parameter (DTensor, storage placements) and every persistent
  buffer (whole, the same on every rank: NOTE [buffers] in meshlm/lowering/buffers.py; the
  non-persistent ones are not saved, as ``state_dict`` leaves them out);
* ``master/<fqn>``: the optimizer's master copy when its dtype differs from the
  parameter's (bf16 ZeRO-1/2 under ``meshlm train``: the fp32 weights, which the bf16
  parameter rounds); a load takes the weights from it where saved (NOTE [checkpoint
  weights] in _ckpt_weights.py); same-dtype masters (fp32 ZeRO-1/2) are rebuilt from the
  parameter on load;
* ``optim/<fqn>/<key>``: each tensor of the torch optimizer's per-parameter state, keyed
  by parameter FQN, never by index (so it reshards and survives a reordering);
* ``meta.json`` (rank 0): step, model config, layout, mesh, world size, the caller's
  ``run_meta``, and a size and CRC-32 for every file of the checkpoint;
* ``extra.pt`` (rank 0): the caller's ``extra`` dict (step, data-loader position, LR
  schedule, ...), the optimizer's param-group hyperparameters and non-tensor state;
* ``rng/rank<r>.pt``: each rank's torch RNG states (restored when the world size is
  unchanged; ``meshlm train`` does not depend on them: it seeds every micro-batch from
  (train.seed, step, micro-batch), NOTE [checkpoint rng] in meshlm/rng.py).

NOTE [commit protocol]: ranks write into ``<dir>/.tmp_step_<N>/``; after a barrier rank 0
writes ``meta.json``, then the ``COMMIT`` marker, fsyncs, and renames the directory to
``step_<N>`` (atomic on POSIX), then fsyncs ``<dir>``.  ``resume='auto'`` only considers
``step_*`` directories that hold ``COMMIT``, so a process killed at any moment leaves
either a complete checkpoint or one that is ignored (and deleted by the next save).  Of
those it takes the newest whose files check out (NOTE [damaged checkpoints]); a save that
cannot write (a full disk) removes its partial directory and stops (NOTE [failed save]).
Reading a checkpoint runs no code from it (NOTE [trusted checkpoint files] in _ckpt_load.py).

NOTE [one writer per checkpoint directory] (_ckpt_lock.py): a Checkpointer holds
``<dir>/LOCK`` from ``resume()`` (or its first save) to ``close()``; a second run into the
directory stops with a CheckpointError naming the holder.

Every failure to load (missing or truncated file, CRC mismatch, a tensor of another
shape, a missing key) raises :class:`meshlm.errors.CheckpointError` on *every* rank, after
the ranks have agreed on it, so a bad checkpoint never hangs a job.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from meshlm import _ckpt_lock
from meshlm import _ckpt_runs as _runs
from meshlm._ckpt_files import (  # noqa: F401 (re-exported: meshlm.checkpoint is the API)
    _STEP_RE,
    COMMIT,
    EXTRA,
    FORMAT,
    META,
    _agree,
    _atomic_write,
    _barrier,
    _bcast,
    _crc32,
    _dist,
    _fsync_dir,
    _gather,
    _inner,
    _masters,
    _params,
    _rank,
    _resident,
    _step_dir,
    _tmp_dir,
    _world,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    resolve_path,
)
from meshlm._ckpt_load import check_checkpoint, load_checkpoint, verify_checkpoint
from meshlm.errors import CheckpointError
from meshlm.lowering.buffers import persistent as persistent_buffers

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "read_meta",
    "verify_checkpoint",
    "check_checkpoint",
    "COMMIT",
    "META",
]


try:  # the train owner's config module defines the dataclass; fall back to our own copy
    from meshlm.config import CheckpointConfig  # type: ignore[attr-defined]
except Exception:  # noqa: BLE001  (config.py may not exist yet, or not define it)

    @dataclass
    class CheckpointConfig:  # type: ignore[no-redef]
        """The ``checkpoint`` config section."""

        dir: Optional[str] = None  #: where step_<N> directories go; None = no checkpoints
        every: int = 0  #: save every N steps (0 = only when save() is called)
        keep: int = 3  #: keep the last N complete checkpoints (0 = keep all)
        resume: Optional[str] = None  #: None, 'auto' (latest complete in dir) or a path


# --------------------------------------------------------------------------- process group
def _tensor_state(model: nn.Module, optimizer: Any) -> tuple[dict[str, Tensor], dict]:
    """The flat DCP state dict, and the non-tensor optimizer state (for extra.pt)."""
    sd: dict[str, Tensor] = {}
    params = _params(model)
    for fqn, p in params.items():
        sd[f"model/{fqn}"] = p.detach()
    for fqn, b in persistent_buffers(model).items():  # NOTE [buffers]: equal on every rank
        sd[f"model/{fqn}"] = b.detach()
    other: dict[str, dict] = {}
    groups: list[dict] = []
    if optimizer is not None:
        masters = _masters(optimizer)
        inner = _inner(optimizer)
        by_id = {id(m): fqn for fqn, m in masters.items()}
        for fqn, m in masters.items():
            if m is not params[fqn] and m.dtype != params[fqn].dtype:
                sd[f"master/{fqn}"] = m.detach()
            for k, v in inner.state.get(m, {}).items():
                if isinstance(v, Tensor):
                    sd[f"optim/{fqn}/{k}"] = v
                else:
                    other.setdefault(fqn, {})[k] = v
        for g in inner.param_groups:
            groups.append(
                {"params": [by_id[id(p)] for p in g["params"]], **{k: v for k, v in g.items() if k != "params"}}
            )
    return sd, {"optim_other": other, "param_groups": groups}


def _model_info(model: nn.Module) -> dict:
    info: dict[str, Any] = {
        "class": type(model).__mro__[1].__name__ if hasattr(model, "_meshlm_state") else type(model).__name__
    }
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        info["config"] = cfg.to_dict()
    st = getattr(model, "_meshlm_state", None)
    if st is not None:
        info["layout"] = {"source": str(st.layout.source), "name": getattr(st.layout, "name", None)}
        info["mesh"] = dict(st.sizes)
    info["shapes"] = {fqn: list(p.shape) for fqn, p in _params(model).items()}
    return info


# --------------------------------------------------------------------------- save
def save_checkpoint(
    root: str,
    step: int,
    *,
    model: nn.Module,
    optimizer: Any = None,
    extra: Optional[dict] = None,
    run_meta: Optional[dict] = None,
    keep: int = 0,
    run_id: Optional[str] = None,
) -> str:
    """Save a complete checkpoint of step ``step`` under ``root`` (collective: every rank
    calls it) and return its directory.  See NOTE [commit protocol].  ``run_id`` goes into
    meta.json; ``keep`` > 0 deletes the oldest checkpoints of that run only, and a complete
    ``step_<N>`` that exists already is never replaced (NOTE [one run per checkpoint
    directory] in _ckpt_runs.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

    rank = _rank()
    final, tmp = _step_dir(root, step), _tmp_dir(root, step)
    err = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if is_complete(final):
                raise CheckpointError(
                    f"checkpoint.dir={root!r}: {final} exists (run {_runs.checkpoint_run_id(final)}); a checkpoint is "
                    "never overwritten: move it away, or save into another checkpoint.dir"
                )
            for stale in (tmp, final):  # a torn earlier attempt
                if os.path.exists(stale):
                    shutil.rmtree(stale)
            os.makedirs(os.path.join(tmp, "rng"))
            if run_id is not None:
                _runs.claim(root, run_id)
        except OSError as e:
            err = _failure_line(root, step, _describe(e), None, removed=None)
        except CheckpointError as e:
            err = str(e)
    _agree(err)
    # NOTE [failed save]: each rank writes its part; all learn whether every rank did
    mine: dict[str, dict] = {}
    what, my_bytes = None, 0
    try:
        with _resident(optimizer):
            sd, opt_extra = _tensor_state(model, optimizer)
            my_bytes = sum(_local_bytes(t) for t in sd.values())
            dcp.save(
                sd, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
            )
        del sd
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        rngf = os.path.join("rng", f"rank{rank}.pt")
        with open(os.path.join(tmp, rngf), "wb") as fh:  # a plain write: a full disk is an OSError
            fh.write(_torch_bytes(rng))
        # each rank checksums the files it wrote; rank 0 lists them all in meta.json
        for name in sorted(os.listdir(tmp)):
            if name.startswith(f"__{rank}_") and name.endswith(".distcp"):
                f = os.path.join(tmp, name)
                mine[name] = {"bytes": os.path.getsize(f), "crc32": _crc32(f)}
        mine[rngf] = {"bytes": os.path.getsize(os.path.join(tmp, rngf)), "crc32": _crc32(os.path.join(tmp, rngf))}
    except (OSError, CheckpointException) as e:  # CheckpointException: DCP's, every rank's failures
        what = _describe(e)
    files: dict[str, dict] = {}
    failed, nbytes = [], 0
    for w, theirs, n in _gather((what, mine, my_bytes)):
        files.update(theirs)
        nbytes += n
        failed += [w] if w is not None else []
    what = failed[0] if failed else None
    if what is None and rank == 0:
        try:
            _commit(root, step, tmp, final, files, model, extra, opt_extra, run_meta, run_id)
        except OSError as e:
            what = _describe(e)
    _settle_save(root, step, tmp, what, nbytes)
    if rank == 0:
        try:
            _retire(root, run_id, keep)
        except OSError:  # the checkpoint is committed; what is not deleted now goes at the next save
            pass
    _barrier()
    return final


def _commit(root, step, tmp, final, files, model, extra, opt_extra, run_meta, run_id) -> None:
    """Rank 0's part of a save once every rank wrote its files: extra.pt, meta.json, COMMIT,
    the rename (NOTE [commit protocol])."""
    buf = _torch_bytes({"extra": dict(extra or {}), **opt_extra})
    _atomic_write(os.path.join(tmp, EXTRA), buf)
    files[EXTRA] = {"bytes": len(buf), "crc32": zlib.crc32(buf)}
    md = os.path.join(tmp, ".metadata")
    files[".metadata"] = {"bytes": os.path.getsize(md), "crc32": _crc32(md)}
    meta = {
        "format": FORMAT,
        "step": int(step),
        "run_id": run_id,
        "world_size": _world(),
        "time": time.time(),
        "torch": torch.__version__,
        "model": _model_info(model),
        "run": _jsonable(run_meta or {}),
        "files": files,
    }
    _atomic_write(os.path.join(tmp, META), json.dumps(meta, indent=1, sort_keys=True).encode())
    _atomic_write(os.path.join(tmp, COMMIT), f"{step}\n".encode())
    _fsync_dir(tmp)
    os.rename(tmp, final)  # NOTE [commit protocol]: the checkpoint becomes visible here
    _fsync_dir(root)


def _retire(root: str, run_id: Optional[str], keep: int) -> None:
    """After a save: delete this run's checkpoints beyond the last ``keep``, and torn saves."""
    if keep > 0:
        for _s, old in _runs.own(list_checkpoints(root), run_id)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    for name in os.listdir(root):  # torn saves of other steps
        if name.startswith(".tmp_step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# NOTE [failed save]
#     A save that fails to write (a full disk, a quota, a file system gone read-only) stops
#     the run with one line on every rank, after the ranks agreed on it (no hang): the
#     directory, the file and the error, and for a full disk the bytes free there and about
#     how many the checkpoint needs (its tensor bytes, summed over the ranks).  Rank 0 first
#     removes the partial ``.tmp_step_<N>``; the complete checkpoints are never touched
#     (retention runs only after a commit), so ``checkpoint.resume=auto`` continues from the
#     last one once there is room.
def _describe(e: BaseException) -> dict:
    """What failed, picklable: errno, its text and the file (from the OSError inside DCP's
    CheckpointException where there is one), else the error's first line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: rank -> (exception, traceback)
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        e = next((x for x in inner if isinstance(x, OSError)), inner[0] if inner else e)
    seen = e
    while not isinstance(seen, OSError) and (seen.__cause__ or seen.__context__) is not None:
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError) and seen.errno is not None:
        return {"errno": seen.errno, "text": seen.strerror or os.strerror(seen.errno), "file": seen.filename}
    lines = str(e).strip().splitlines()
    return {"errno": None, "text": f"{type(e).__name__}: {lines[0] if lines else ''}", "file": None}


def _size(n: Optional[int]) -> str:
    if n is None:
        return "an unknown number of bytes"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _failure_line(root: str, step: int, what: dict, nbytes: Optional[int], removed: Optional[str]) -> str:
    where = f" ({what['file']})" if what.get("file") else ""
    line = f"checkpoint.dir={root!r}: saving step {step} failed: {what['text']}{where}"
    if what.get("errno") in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = None
        line += f"; {_size(free)} free there" + (f", the checkpoint needs about {_size(nbytes)}" if nbytes else "")
    if removed:
        line += f"; removed the partial save {removed}, the complete checkpoints are untouched"
    fix = (
        "free space (or lower checkpoint.keep), or set checkpoint.dir to a larger disk"
        if what.get("errno") in (errno.ENOSPC, errno.EDQUOT)
        else "make checkpoint.dir writable, or set it to a writable directory"
    )
    return f"{line}. To continue: {fix}, then resume with checkpoint.resume=auto"


def _settle_save(root: str, step: int, tmp: str, what: Optional[dict], nbytes: int) -> None:
    """Raise the same CheckpointError on every rank when any rank's part of the save failed
    (NOTE [failed save]), rank 0 having removed the partial ``tmp``; else return."""
    failed = [w for w in _gather(what) if w is not None]
    if not failed:
        return
    line = None
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        line = _failure_line(root, step, failed[0], nbytes, removed=tmp)
    raise CheckpointError(_bcast(line))


def _local_bytes(t: Tensor) -> int:
    """The bytes of ``t`` this rank holds (a DTensor's local shard)."""
    local = getattr(t, "to_local", None)
    t = local() if local is not None else t
    return t.numel() * t.element_size()


def _torch_bytes(obj: Any) -> bytes:
    import io

    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        if hasattr(obj, "__dataclass_fields__"):
            from dataclasses import asdict

            return _jsonable(asdict(obj))
        return repr(obj)


# --------------------------------------------------------------------------- lock
def lock_dir(root: str, run_dir: Optional[str] = None) -> Optional[_ckpt_lock.DirLock]:
    """Take ``root``'s lock on rank 0 (collective: every rank calls it, and every rank raises
    the same CheckpointError when another run holds it); rank 0's lock, None elsewhere
    (NOTE [one writer per checkpoint directory] in _ckpt_lock.py)."""
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
def _stderr(line: str) -> None:
    print(f"meshlm: {line}", file=sys.stderr, flush=True)


# NOTE [damaged checkpoints]
#     ``checkpoint.resume=auto`` takes the newest checkpoint whose files check out
#     (``check_checkpoint``: COMMIT, meta.json, every file's size and CRC-32, DCP's
#     metadata read without running code).  Each newer one that does not is never loaded:
#     rank 0 renames it ``step_<N>.damaged`` (kept for inspection; no listing, resume or
#     retention sees it, and the step can be saved again) and says which and why.  When no
#     checkpoint checks out, nothing is loaded or moved and the resume stops with every
#     reason.  An explicit ``checkpoint.resume=PATH`` is loaded as named, or refused.
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
        from meshlm.config import check_resume

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
        from meshlm.config import check_resume

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
        )
        return self.last_saved

    def close(self) -> None:
        """Let go of ``cfg.dir``'s lock (nothing else is pending: saves are synchronous)."""
        self._unlock()
