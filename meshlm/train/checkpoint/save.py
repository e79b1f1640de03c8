"""Writing a checkpoint: every rank's shards, then rank 0's commit (NOTE [commit protocol] in
meshlm/train/checkpoint/__init__.py); retiring old ones; a failed save's one-line report
(NOTE [failed save])."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
import zlib
from typing import Any, Optional

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError
from meshlm.runtime.hooks import original_class
from meshlm.runtime.lowering.buffers import persistent as persistent_buffers
from meshlm.train.checkpoint import runs as _runs
from meshlm.train.checkpoint.files import (
    COMMIT,
    EXTRA,
    FORMAT,
    META,
    _agree,
    _atomic_write,
    _barrier,
    _bcast,
    _crc32,
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
    list_checkpoints,
)


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
    info: dict[str, Any] = {"class": original_class(type(model)).__name__}  # the user's, not Sharded<...>
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
    assets: Optional[dict[str, str]] = None,
) -> str:
    """Save a complete checkpoint of step ``step`` under ``root`` (collective: every rank
    calls it) and return its directory.  See NOTE [commit protocol].  ``run_id`` goes into
    meta.json; ``keep`` > 0 deletes the oldest checkpoints of that run only, and a complete
    ``step_<N>`` that exists already is never replaced (NOTE [one run per checkpoint
    directory] in meshlm/train/checkpoint/runs.py).  ``assets``: name -> path of files rank 0
    copies into the checkpoint beside the tensors (the run's tokenizer: NOTE [run tokenizer]
    in meshlm/train/checkpoint/assets.py), checked by CRC-32 like every other file."""
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
            _copy_files(tmp, dict(assets or {}), files)
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


def _copy_files(tmp: str, sources: dict[str, str], files: dict[str, dict]) -> None:
    """Rank 0: ``sources`` (name -> path) copied into the checkpoint, each listed in ``files``."""
    for name, src in sources.items():
        dst = os.path.join(tmp, name)
        shutil.copyfile(src, dst)
        files[name] = {"bytes": os.path.getsize(dst), "crc32": _crc32(dst)}


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
