"""Verify and load a checkpoint (meshlm.train.checkpoint; import the functions from there).

``load_checkpoint`` checks a checkpoint's files (``verify_checkpoint``: commit marker, sizes,
CRC-32) and every key and global shape against the model (``_plan_load``), with every rank
agreeing on the outcome before DCP reads anything, so a bad checkpoint raises the same
:class:`CheckpointError` on every rank and never hangs a job.  ``check_checkpoint`` runs the
same file checks and answers instead of raising (``checkpoint.resume=auto`` skips a damaged
checkpoint with it).

NOTE [trusted checkpoint files]
    Reading a checkpoint runs no code from it, whoever wrote it.  The files read are
    ``meta.json`` (JSON), ``COMMIT`` (text), DCP's ``.metadata`` (a pickle, read through an
    allow-list of the classes a DCP metadata holds: meshlm/_torch_compat/dcp_metadata.py),
    the ``.distcp`` shards (tensors, read by DCP with ``torch.load(weights_only=True)``; a
    non-tensor entry, which DCP would read with ``weights_only=False``, is refused),
    ``extra.pt`` and ``rng/rank<r>.pt`` (``torch.load(weights_only=True)``).  Every byte
    range the metadata names must lie inside a file of the checkpoint directory.  Hugging
    Face weights are read from safetensors, or a ``pytorch_model.bin`` with
    ``weights_only=True`` (hf_load.py); the offload store reads raw bytes.  Anything else in
    a file is a :class:`CheckpointError` naming the file.  The CRC-32s in ``meta.json`` catch
    damage, not tampering: whoever can write ``.metadata`` can rewrite ``meta.json``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm._torch_compat import dcp_metadata
from meshlm.core.errors import CheckpointError
from meshlm.runtime.absent import absent_params
from meshlm.runtime.lowering.buffers import persistent as persistent_buffers
from meshlm.train.checkpoint.files import (
    COMMIT,
    EXTRA,
    _agree,
    _bcast,
    _crc32,
    _gather,
    _inner,
    _masters,
    _params,
    _rank,
    _resident,
    _world,
    read_meta,
    resolve_path,
)
from meshlm.train.checkpoint.weights import copy_followers, drop_grads, weight_targets


def verify_checkpoint(path: str, meta: Optional[dict] = None, *, crc: bool = True) -> Optional[str]:
    """What is wrong with the files of checkpoint ``path`` (first problem), or None.

    Checks the commit marker, that every file listed in ``meta.json`` exists with its size
    and CRC-32, and that every byte range the DCP metadata points at lies inside its file.
    Local only (no collectives)."""
    if not os.path.isdir(path):
        return f"checkpoint {path}: no such directory"
    if not os.path.isfile(os.path.join(path, COMMIT)):
        return (
            f"checkpoint {path}: no {COMMIT} marker, so the save that wrote it did not finish "
            "(killed mid-save?); resume from an earlier step_* directory or use checkpoint.resume=auto"
        )
    try:
        meta = meta or read_meta(path)
    except CheckpointError as e:
        return str(e)
    for name, want in sorted(meta.get("files", {}).items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return (
                f"checkpoint {path}: shard file {f} is missing (meta.json lists it with {want['bytes']} bytes); "
                "the checkpoint is incomplete: copy the whole directory, or resume from another checkpoint"
            )
        size = os.path.getsize(f)
        if size != want["bytes"]:
            return (
                f"checkpoint {path}: file {f} has {size} bytes but meta.json records {want['bytes']} "
                f"({'truncated' if size < want['bytes'] else 'grown'}); the checkpoint is corrupted, resume from another one"
            )
        if crc:
            got = _crc32(f)
            if got != want["crc32"]:
                return (
                    f"checkpoint {path}: file {f} fails its CRC-32 check (0x{got:08x}, meta.json records "
                    f"0x{want['crc32']:08x}); the file is corrupted, resume from another checkpoint"
                )
    return None


def _read_dcp_metadata(path: str):
    """DCP's metadata of checkpoint ``path``, read without running code (NOTE [trusted
    checkpoint files]), its byte ranges checked against the files; raises CheckpointError."""
    f = os.path.join(path, ".metadata")
    try:
        md = dcp_metadata.read_metadata(f)
    except dcp_metadata.UnsafeMetadata as e:
        raise CheckpointError(
            f"checkpoint {path}: {f} refused: {e}, so it was damaged or tampered with (meshlm reads checkpoint "
            "metadata without running code); do not use this checkpoint, resume from another one"
        ) from None
    except Exception as e:  # noqa: BLE001 (any unpickling error means a bad file)
        raise CheckpointError(
            f"checkpoint {path}: {f} is unreadable ({type(e).__name__}: {e}); the checkpoint is corrupted, "
            "resume from another one"
        ) from None
    _check_storage(path, md)
    return md


def _check_storage(path: str, md) -> None:
    """Every byte range DCP's metadata names lies inside a file of directory ``path``."""
    f = os.path.join(path, ".metadata")
    sizes: dict[str, int] = {}
    try:
        for info in md.storage_data.values():
            name, end = info.relative_path, int(info.offset) + int(info.length)
            if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
                raise CheckpointError(
                    f"checkpoint {path}: {f} points at {name!r}, outside the checkpoint directory; it was damaged "
                    "or tampered with, resume from another checkpoint"
                )
            if name not in sizes:
                g = os.path.join(path, name)
                sizes[name] = os.path.getsize(g) if os.path.isfile(g) else -1
            if sizes[name] < end:
                what = "is missing" if sizes[name] < 0 else f"has {sizes[name]} bytes"
                raise CheckpointError(
                    f"checkpoint {path}: shard file {os.path.join(path, name)} {what}, but {f} points at bytes up to "
                    f"{end}; the checkpoint is incomplete or corrupted, resume from another one"
                )
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {f} is malformed ({type(e).__name__}: {e})") from None


def _fmt_shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ")"


def _plan_load(path: str, md, model: nn.Module, optimizer: Any, meta: dict) -> tuple[dict[str, Tensor], list]:
    """The DCP state dict to load into (creating optimizer state where missing), after
    checking every key and global shape against the checkpoint; raises CheckpointError."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = md.state_dict_metadata
    params = _params(model)
    cfg_note = ""
    if meta.get("model", {}).get("config"):
        cfg_note = f" (saved model config: {meta['model']['config']})"
    for fqn, p in params.items():
        key = f"model/{fqn}"
        if key not in saved:
            raise CheckpointError(
                f"checkpoint {path}: has no parameter `{fqn}` that the model has; it was saved "
                f"from a different model{cfg_note}"
            )
        m = saved[key]
        if not isinstance(m, TensorStorageMetadata) or tuple(m.size) != tuple(p.shape):
            got = _fmt_shape(m.size) if isinstance(m, TensorStorageMetadata) else "a non-tensor"
            raise CheckpointError(
                f"checkpoint {path}: parameter `{fqn}` has shape {got} there but the model "
                f"expects {_fmt_shape(p.shape)}: a different model shape{cfg_note}. Build the "
                "model with the saved config, or start without checkpoint.resume"
            )
        mm = saved.get(f"master/{fqn}")
        if mm is not None and (not isinstance(mm, TensorStorageMetadata) or tuple(mm.size) != tuple(p.shape)):
            raise CheckpointError(
                f"checkpoint {path}: the master of `{fqn}` has shape "
                f"{_fmt_shape(mm.size) if isinstance(mm, TensorStorageMetadata) else 'no shape'}, its parameter "
                f"{_fmt_shape(p.shape)}"
            )
    bufs = persistent_buffers(model)  # NOTE [buffers] in meshlm/runtime/lowering/buffers.py
    for fqn, b in bufs.items():
        m = saved.get(f"model/{fqn}")
        if not isinstance(m, TensorStorageMetadata) or tuple(m.size) != tuple(b.shape):
            got = (
                "none" if m is None else _fmt_shape(m.size) if isinstance(m, TensorStorageMetadata) else "a non-tensor"
            )
            raise CheckpointError(
                f"checkpoint {path}: buffer `{fqn}` of shape {_fmt_shape(b.shape)} is {got} there: it was saved "
                f"from a different model{cfg_note}"
            )
    elsewhere = absent_params(model)  # another pipeline stage's: loaded there (NOTE [absent values])
    extra_keys = sorted(
        k[len("model/") :]
        for k in saved
        if k.startswith("model/") and k[len("model/") :] not in params | bufs and k[len("model/") :] not in elsewhere
    )
    if extra_keys:
        raise CheckpointError(
            f"checkpoint {path}: has parameters the model lacks ({', '.join(extra_keys[:5])}); "
            f"it was saved from a different model{cfg_note}"
        )
    masters = _masters(optimizer)
    sd, post = weight_targets(saved, params, masters)  # NOTE [checkpoint weights]
    sd.update({f"model/{fqn}": b for fqn, b in bufs.items()})  # loaded in place, whole on every rank
    if optimizer is not None:
        inner = _inner(optimizer)
        for fqn, m in masters.items():
            prefix = f"optim/{fqn}/"
            keys = [k for k in saved if k.startswith(prefix)]
            if not keys:
                continue  # saved before the first step: keep the fresh state
            state = inner.state.setdefault(m, {})
            for k in keys:
                name = k[len(prefix) :]
                km = saved[k]
                if not isinstance(km, TensorStorageMetadata):
                    continue
                cur = state.get(name)
                size = tuple(km.size)
                if size == tuple(m.shape):
                    if cur is None or tuple(cur.shape) != size:
                        cur = torch.zeros_like(m.detach(), dtype=km.properties.dtype)
                elif size == ():
                    if cur is None or cur.ndim != 0 or isinstance(cur, DTensor):
                        cur = torch.zeros((), dtype=km.properties.dtype)
                elif _whole(m):  # NOTE [whole-tensor step]: state of its own shape (Adafactor's row_var), whole
                    if cur is None or tuple(cur.shape) != size:
                        cur = _replicated_zeros(m, size, km.properties.dtype)
                else:
                    raise CheckpointError(
                        f"checkpoint {path}: optimizer state `{name}` of `{fqn}` has shape "
                        f"{_fmt_shape(size)} but the parameter has {_fmt_shape(m.shape)}"
                    )
                state[name] = cur
                sd[k] = cur
    for k in sd:  # NOTE [trusted checkpoint files]: what DCP would unpickle is never loaded
        if not isinstance(saved.get(k), TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {path}: `{k}` is not stored as a tensor there; it was not written by meshlm"
            )
    return sd, post


def _whole(m: Tensor) -> bool:
    """A master every rank holds whole (a plain tensor, or a DTensor replicated on every
    mesh axis: NOTE [whole-tensor step] in meshlm/runtime/optim/chunks.py)."""
    return not isinstance(m, DTensor) or all(p.is_replicate() for p in m.placements)


def _replicated_zeros(m: Tensor, size: tuple, dtype: torch.dtype) -> Tensor:
    """Zeros of ``size`` placed as master ``m`` is (whole on every rank)."""
    if not isinstance(m, DTensor):
        return torch.zeros(size, dtype=dtype, device=m.device)
    local = torch.zeros(size, dtype=dtype, device=m.to_local().device)
    return DTensor.from_local(local, m.device_mesh, m.placements, run_check=False)


def _meta_everywhere(path: str) -> tuple[Optional[dict], Optional[str]]:
    """(meta.json of checkpoint ``path``, None) or (None, what is wrong) on every rank; rank 0 reads."""
    meta, err = None, None
    if _rank() == 0:
        try:
            if not os.path.isdir(path):
                read_meta(path)  # says what is there instead
                raise CheckpointError(f"checkpoint {path}: no such directory")
            if not os.path.isfile(os.path.join(path, COMMIT)):
                raise CheckpointError(verify_checkpoint(path) or f"checkpoint {path}: incomplete")
            meta = read_meta(path)
        except CheckpointError as e:
            err = str(e)
    return _bcast((meta, err))


def _verify_share(path: str, meta: dict) -> Optional[str]:
    """verify_checkpoint on every world-th file of ``meta`` per rank: the first problem any
    rank found, on every rank (collective)."""
    rank, world = _rank(), _world()
    names = sorted(meta.get("files", {}))
    part = {"files": {n: meta["files"][n] for i, n in enumerate(names) if i % world == rank}}
    errors = [e for e in _gather(verify_checkpoint(path, part)) if e]
    return errors[0] if errors else None


def check_checkpoint(path: str) -> Optional[str]:
    """What is wrong with the files of checkpoint ``path`` (its commit marker, meta.json,
    every file's size and CRC-32, DCP's metadata and the byte ranges it names), or None; the
    same answer on every rank.  Collective: the ranks share the checksumming."""
    meta, err = _meta_everywhere(path)
    if err is None:
        err = _verify_share(path, meta or {})
    if err is None and _rank() == 0:
        try:
            _read_dcp_metadata(path)
        except CheckpointError as e:
            err = str(e)
    return _bcast(err)


def load_checkpoint(
    path: str, *, model: nn.Module, optimizer: Any = None, verify: bool = True, restore_rng: bool = True
) -> dict:
    """Load checkpoint ``path`` into ``model`` (and ``optimizer``) in place, under whatever
    layout and mesh they are sharded with now; return the saved ``extra`` dict.  Collective.
    Raises :class:`CheckpointError` (on every rank) for a bad or mismatched checkpoint."""
    path = resolve_path(path)
    rank, world = _rank(), _world()
    # rank 0 reads meta.json; each rank verifies every world-th file; all agree before DCP runs
    meta, err = _meta_everywhere(path)
    if err:
        raise CheckpointError(err)
    if verify:
        _agree(_verify_share(path, meta))
    with _resident(optimizer):  # offloaded optimizer state is loaded into memory, then moved out again
        blob = _load_tensors(path, meta, model, optimizer)
    if restore_rng and meta.get("world_size") == world:
        f = os.path.join(path, "rng", f"rank{rank}.pt")
        if os.path.isfile(f):
            rng = torch.load(f, weights_only=True)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
    extra = dict(blob.get("extra", {}))
    extra.setdefault("step", meta.get("step"))
    return extra


def _load_tensors(path: str, meta: dict, model: nn.Module, optimizer: Any) -> dict:
    """Load the checkpoint's tensors into ``model`` and ``optimizer``; return extra.pt's dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    err = None
    try:
        md = _read_dcp_metadata(path)
        sd, post = _plan_load(path, md, model, optimizer, meta)
    except CheckpointError as e:
        err, sd, post = str(e), {}, []
    _agree(err)
    try:  # NOTE [trusted checkpoint files]: DCP's reader and planner, without their unpickling
        dcp.load(sd, storage_reader=dcp_metadata.SafeReader(path), planner=dcp_metadata.TensorsOnlyPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (DCP gathers every rank's error: all land here)
        raise CheckpointError(f"checkpoint {path}: loading failed ({_first_line(e)})") from None
    copy_followers(post)  # NOTE [checkpoint weights]: what did not load the weights follows them
    drop_grads(_params(model), optimizer)  # gradients of the replaced weights
    try:
        blob = torch.load(os.path.join(path, EXTRA), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"checkpoint {path}: {os.path.join(path, EXTRA)} is unreadable ({type(e).__name__}: {e})"
        ) from None
    if optimizer is not None:
        _restore_groups(path, optimizer, blob)
    return blob


def _first_line(e: BaseException) -> str:
    """``Type: message`` of ``e`` (of the first rank's error for DCP's CheckpointException,
    whose text is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:500] if text else ''}"


def _restore_groups(path: str, optimizer: Any, blob: dict) -> None:
    inner = _inner(optimizer)
    masters = _masters(optimizer)
    by_fqn_group = {}
    for i, g in enumerate(inner.param_groups):
        for p in g["params"]:
            fqn = next((f for f, m in masters.items() if m is p), None)
            if fqn is not None:
                by_fqn_group[fqn] = i
    for sg in blob.get("param_groups", []):
        idx = {by_fqn_group.get(f) for f in sg["params"]} - {None}
        for i in idx:
            for k, v in sg.items():
                if k != "params":
                    inner.param_groups[i][k] = v
    for fqn, other in blob.get("optim_other", {}).items():
        if fqn in masters:
            inner.state.setdefault(masters[fqn], {}).update(other)
