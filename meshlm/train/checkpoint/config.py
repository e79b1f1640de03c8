"""The ``checkpoint`` config section and its checks: the section :class:`Checkpointer` takes,
and what ``checkpoint.resume`` and ``checkpoint.dir`` may be (checked before any worker
starts, and again by the Checkpointer)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from meshlm.core.errors import ConfigError


@dataclass
class CheckpointConfig:
    """``checkpoint`` (meshlm.train.checkpoint.Checkpointer)."""

    dir: Optional[str] = None  #: save under this directory; None: no checkpoints
    every: int = 0  #: save every N steps; 0: only the last step (and on SIGTERM/SIGINT)
    keep: int = 3  #: keep the newest N of this run (another run's checkpoints are never deleted)
    resume: Optional[str] = None  #: null (start fresh), auto (the latest complete one in dir) or a path


# checkpoint.resume is null (start fresh), auto (the latest complete checkpoint in
# checkpoint.dir) or a path; other words for the first two are errors naming the right one.
_RESUME_WORDS = {"latest": "auto", "last": "auto", "none": "null", "never": "null", "": "null"}


def check_resume(value: Any) -> None:
    """Raise ConfigError for another spelling of ``checkpoint.resume=auto`` or ``=null``."""
    right = _RESUME_WORDS.get(value.strip().lower()) if isinstance(value, str) else None
    if right == "auto":
        raise ConfigError(
            f"checkpoint.resume={value!r}: write checkpoint.resume=auto for the latest complete "
            f"checkpoint in checkpoint.dir (for a directory named {value}, write ./{value})"
        )
    if right == "null":
        raise ConfigError(
            f"checkpoint.resume={value!r}: write checkpoint.resume=null to start without resuming "
            "(or auto, or the path of a checkpoint)"
        )


def check_checkpoint_dir(path: Optional[str]) -> None:
    """Raise ConfigError when ``checkpoint.dir`` cannot hold checkpoints: it is a file, it
    lies under a file, or the directory it is (or would be made in) is not writable (a
    read-only file system, permissions).  Local and cheap: the launcher calls it before any
    worker starts.  A disk that fills up later is a save's error (NOTE [failed save] in
    meshlm/train/checkpoint/__init__.py)."""
    if not path:
        return
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(
            f"checkpoint.dir={path!r} is a file, not a directory; set checkpoint.dir to a directory "
            "(it is created if missing)"
        )
    there = p
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise ConfigError(
            f"checkpoint.dir={path!r}: {there} is a file, so no directory can be made under it; "
            "set checkpoint.dir to a path under a directory"
        )
    try:
        read_only = bool(os.statvfs(there).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    if read_only or not os.access(there, os.W_OK | os.X_OK):
        why = "on a read-only file system" if read_only else "not writable by this user"
        raise ConfigError(f"checkpoint.dir={path!r}: {there} is {why}; set checkpoint.dir to a writable directory")
