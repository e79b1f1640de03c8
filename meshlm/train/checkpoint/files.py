"""The files of a checkpoint directory and the rank helpers every part of checkpointing
uses: names, listing, the meta file, atomic writes, checksums, broadcast and agreement
across ranks.  Below ``checkpoint.py`` (saving, the Checkpointer) and ``_ckpt_load.py``
(verifying and loading), which both import from here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError

COMMIT = "COMMIT"
META = "meta.json"
EXTRA = "extra.pt"
FORMAT = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _bcast(obj: Any) -> Any:
    """``obj`` of rank 0 on every rank."""
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any]:
    if not _dist():
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _agree(error: Optional[str]) -> None:
    """Raise the same CheckpointError on every rank if any rank saw one (no hang)."""
    errors = [e for e in _gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])


# --------------------------------------------------------------------------- files
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _tmp_dir(root: str, step: int) -> str:
    return os.path.join(root, f".tmp_step_{step:08d}")


def is_complete(path: str) -> bool:
    """A checkpoint directory that was committed (``COMMIT`` and ``meta.json`` present)."""
    return os.path.isfile(os.path.join(path, COMMIT)) and os.path.isfile(os.path.join(path, META))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and is_complete(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint in ``root`` (incomplete ones are ignored), or None."""
    cps = list_checkpoints(root)
    return cps[-1][1] if cps else None


def read_meta(path: str) -> dict:
    """The ``meta.json`` of a checkpoint directory; CheckpointError if absent or unreadable."""
    f = os.path.join(path, META)
    if not os.path.isdir(path):
        what = "is a file, not" if os.path.exists(path) else "does not exist; it is not"
        raise CheckpointError(
            f"checkpoint {path}: {what} a checkpoint directory; give a step_* directory of a checkpoint.dir, "
            "or the checkpoint.dir itself (its latest checkpoint)"
        )
    try:
        with open(f) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(
            f"{f}: missing; {path} is not a complete meshlm checkpoint "
            "(killed during a save?). Resume from an earlier step_* directory "
            "or use checkpoint.resume=auto"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{f}: unreadable ({e}); the checkpoint is corrupted, resume from an earlier one"
        ) from None


def resolve_path(path: str) -> str:
    """A checkpoint directory, or a run directory whose latest complete checkpoint is meant."""
    if (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, META))
        and not os.path.exists(os.path.join(path, ".metadata"))
    ):
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    return path


# --------------------------------------------------------------------------- state
def _params(model: nn.Module) -> dict[str, Tensor]:
    from meshlm.runtime.lowering import iter_params

    return {fqn: p for fqn, _m, _n, p in iter_params(model)}


def _masters(optimizer: Any) -> dict[str, Tensor]:
    if optimizer is None:
        return {}
    if hasattr(optimizer, "masters"):
        return dict(optimizer.masters())
    raise CheckpointError(
        "checkpoint: the optimizer must be a meshlm.runtime.optim.sharded.ShardedOptimizer (it needs masters())"
    )


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "inner", optimizer)


def _resident(optimizer: Any):
    """A context in which ``optimizer``'s offloaded masters and state are in memory, for a
    save or load that reads or writes them all (NOTE [offloaded step] in
    meshlm/runtime/offload/optimizer.py); a no-op for an optimizer without offload."""
    resident = getattr(optimizer, "resident", None)
    return resident() if resident is not None else contextlib.nullcontext()
