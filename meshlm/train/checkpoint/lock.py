"""The lock that lets one run at a time write a checkpoint directory (checkpoint.py).

NOTE [one writer per checkpoint directory]
    Two runs saving into one ``checkpoint.dir`` would each take the other's save in progress
    for a torn one and delete it, and race on ``run.json`` and retention.  So the run that
    writes a directory holds ``<dir>/LOCK`` from before it resumes, cleans or saves anything
    until it ends (rank 0 takes it, before the other ranks touch the directory):

    * ``LOCK`` is created once and never deleted; the holder takes an exclusive
      ``fcntl.flock`` on it without waiting and writes itself into it (host, pid, run
      directory, start time, one JSON line).
    * A run that finds it held stops with a :class:`CheckpointError` naming the holder, before
      it changes anything.
    * A run ending (normally, on a signal or on an error) empties the file and lets go.  The
      kernel drops a flock when its process dies however it dies (``kill -9``, the OOM
      killer, a launcher's death: NOTE [launcher death] in meshlm/app/watchdog.py), so a lock is
      never held by a dead process; a ``LOCK`` that still names a holder but is free was left
      by a process that died, and the next run takes it over, saying whose it was.
    * Other hosts: the flock is the authority there too.  NFS (v3 with lockd, v4), Lustre
      mounted with ``-o flock``, GPFS and BeeGFS pass it between hosts, and a host that
      crashes loses it when the server recovers its locks, so a free lock is taken over
      whoever held it.  A filesystem that refuses flock (Lustre without ``-o flock``: ENOSYS,
      some FUSE ones: EOPNOTSUPP) falls back to the file alone: a holder on this host counts
      while its pid lives, a holder on another host always counts, and the override, for a
      holder known to be gone (its host crashed), is to delete ``<dir>/LOCK``.  Never share a
      directory between hosts over a filesystem that takes flocks locally only (NFS mounted
      with ``local_lock=flock`` or ``local_lock=all``): two hosts could both hold it.

    One process is one writer: taking a lock this process holds already counts it once
    more, and each release gives back one count.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Optional

from meshlm.core.errors import CheckpointError

LOCK_FILE = "LOCK"

# This process's locks by real directory path.  Process-wide on purpose: the kernel's flock
# belongs to the open file, so a second open in this process would find its own lock held.
_HELD: dict[str, "DirLock"] = {}


class DirLock:
    """This process's hold on ``<root>/LOCK``; ``took_over`` is the holder it replaced (a
    process that died holding it), or None."""

    def __init__(self, root: str, key: str, fd: int, holder: dict, took_over: Optional[dict]):
        self.root, self.key, self.fd = root, key, fd
        self.holder, self.took_over = holder, took_over
        self.count = 1

    def release(self) -> None:
        """Give back one count; the last one empties the file and lets go of the lock."""
        if self.count <= 0:
            return
        self.count -= 1
        if self.count:
            return
        _HELD.pop(self.key, None)
        try:
            os.ftruncate(self.fd, 0)  # emptied while still held: never a stale holder
        except OSError:
            pass
        os.close(self.fd)  # closing the last descriptor of the open file drops the flock

    def took_over_line(self) -> Optional[str]:
        """What the takeover of a dead holder's lock says, or None."""
        if not self.took_over:
            return None
        return f"took over {os.path.join(self.root, LOCK_FILE)} from {describe(self.took_over)}, which is gone"


def describe(holder: Optional[dict]) -> str:
    """``pid 123 on host h (run dir /r, since 2026-12-07 05:01:02 UTC)``."""
    if not holder:
        return "a run that has not written its name yet"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    run = f"run dir {holder['run_dir']}, " if holder.get("run_dir") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} ({run}since {when})"


def _read(fd: int) -> Optional[dict]:
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        out = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _alive(pid: object) -> bool:
    """Whether process ``pid`` of this host lives (one we may not signal counts as alive)."""
    if not isinstance(pid, int) or pid <= 0:
        return True  # not a pid we can check: assume the holder lives
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _refuse(root: str, holder: Optional[dict], extra: str = "") -> CheckpointError:
    return CheckpointError(
        f"checkpoint.dir={root!r} is in use by another run: {describe(holder)}; one run writes a checkpoint "
        f"directory at a time ({os.path.join(root, LOCK_FILE)}). Wait for that run to end or stop it, or choose "
        f"another checkpoint.dir{extra}"
    )


def acquire(root: str, run_dir: Optional[str] = None) -> DirLock:
    """Take the lock of checkpoint directory ``root`` (created if absent) for this process,
    or raise :class:`CheckpointError` naming its holder (NOTE [one writer per checkpoint
    directory])."""
    import fcntl

    key = os.path.realpath(root)
    held = _HELD.get(key)
    if held is not None:
        held.count += 1
        return held
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={root!r}: cannot open {os.path.join(root, LOCK_FILE)} ({e})") from None
    host = socket.gethostname()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _refuse(root, _read(fd)) from None
            flocked = False  # no flock on this filesystem: the file alone (NOTE above)
        prev = _read(fd)
        if prev is not None and not flocked:
            if prev.get("host") != host or _alive(prev.get("pid")):
                gone = f"; if it is gone (its host crashed), delete {os.path.join(root, LOCK_FILE)}"
                raise _refuse(root, prev, gone)
        me = {"host": host, "pid": os.getpid(), "run_dir": str(run_dir) if run_dir else None, "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    lock = DirLock(root, key, fd, me, prev)
    _HELD[key] = lock
    return lock


def release_all() -> None:
    """Let go of every lock this process holds (a run that ends on an error)."""
    for lock in list(_HELD.values()):
        lock.count = 1
        lock.release()
