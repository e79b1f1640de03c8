"""Verify and load a checkpoint (meshlm.checkpoint; import the functions from there).

``load_checkpoint`` checks a checkpoint's files (``verify_checkpoint``: commit marker, sizes,
CRC-32) and every key and global shape against the model (``_plan_load``), with every rank
agreeing on the outcome before DCP reads anything, so a bad checkpoint raises the same
:class:`CheckpointError` on every rank and never hangs a job.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm._ckpt_files import (
    COMMIT,
    EXTRA,
    _agree,
    _bcast,
    _crc32,
    _inner,
    _masters,
    _params,
    _rank,
    _resident,
    _world,
    read_meta,
    resolve_path,
)
from meshlm._ckpt_weights import copy_followers, drop_grads, weight_targets
from meshlm.absent import absent_params
from meshlm.errors import CheckpointError
from meshlm.lowering.buffers import persistent as persistent_buffers


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
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 (any unpickling error means a bad file)
        raise CheckpointError(
            f"checkpoint {path}: {os.path.join(path, '.metadata')} is unreadable "
            f"({type(e).__name__}: {e}); the checkpoint is corrupted, resume from another one"
        ) from None


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
        if f"master/{fqn}" in saved and tuple(saved[f"master/{fqn}"].size) != tuple(p.shape):
            raise CheckpointError(
                f"checkpoint {path}: the master of `{fqn}` has shape "
                f"{_fmt_shape(saved[f'master/{fqn}'].size)}, its parameter {_fmt_shape(p.shape)}"
            )
    bufs = persistent_buffers(model)  # NOTE [buffers] in meshlm/lowering/buffers.py
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
                else:
                    raise CheckpointError(
                        f"checkpoint {path}: optimizer state `{name}` of `{fqn}` has shape "
                        f"{_fmt_shape(size)} but the parameter has {_fmt_shape(m.shape)}"
                    )
                state[name] = cur
                sd[k] = cur
    return sd, post


def load_checkpoint(
    path: str, *, model: nn.Module, optimizer: Any = None, verify: bool = True, restore_rng: bool = True
) -> dict:
    """Load checkpoint ``path`` into ``model`` (and ``optimizer``) in place, under whatever
    layout and mesh they are sharded with now; return the saved ``extra`` dict.  Collective.
    Raises :class:`CheckpointError` (on every rank) for a bad or mismatched checkpoint."""
    path = resolve_path(path)
    rank, world = _rank(), _world()
    # rank 0 reads meta.json; each rank verifies every world-th file; all agree before DCP runs
    meta, err = None, None
    if rank == 0:
        try:
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint {path}: no such directory (checkpoint.resume={path!r})")
            if not os.path.isfile(os.path.join(path, COMMIT)):
                raise CheckpointError(verify_checkpoint(path) or f"checkpoint {path}: incomplete")
            meta = read_meta(path)
        except CheckpointError as e:
            err = str(e)
    meta, err = _bcast((meta, err))
    if err:
        raise CheckpointError(err)
    if verify:
        names = sorted(meta.get("files", {}))
        part = {"files": {n: meta["files"][n] for i, n in enumerate(names) if i % world == rank}}
        _agree(verify_checkpoint(path, part))
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
    from torch.distributed.checkpoint import FileSystemReader

    err = None
    try:
        md = _read_dcp_metadata(path)
        sd, post = _plan_load(path, md, model, optimizer, meta)
    except CheckpointError as e:
        err, sd, post = str(e), {}, []
    _agree(err)
    try:
        dcp.load(sd, storage_reader=FileSystemReader(path))
    except Exception as e:  # noqa: BLE001 (DCP gathers every rank's error, so all ranks land here)
        raise CheckpointError(f"checkpoint {path}: loading failed ({type(e).__name__}: {str(e)[:2000]})") from None
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
