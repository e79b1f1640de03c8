"""Hugging Face safetensors <-> sharded meshlm models (Llama and GPT-2), with no full model
on any rank.

* :func:`load_hf` reads ``config.json`` and ``model.safetensors`` (or sharded files and
  ``model.safetensors.index.json``, or ``pytorch_model.bin``) into the meshlm model its
  ``model_type`` names (``llama``: :class:`meshlm.models.Llama`, ``gpt2``:
  :class:`meshlm.models.GPT2`) sharded under any layout: each rank reads only the block of
  each tensor it stores (``safe_open(...).get_slice``).
* :func:`save_hf` writes a live sharded model as a Hugging Face directory
  (``config.json`` + one consolidated ``model.safetensors``) that ``transformers`` loads:
  rank 0 writes the header, then every rank ``pwrite``s the blocks it owns (one replica of
  each) straight to their offsets, so no rank ever holds the whole model.
* :func:`export_checkpoint` does that for a training checkpoint (``meshlm convert``).

What differs between the architectures (names, shapes, how a meshlm block maps onto the HF
tensor, the config) lives in one module per ``model_type``: meshlm/hf_llama.py (NOTE [HF
names]) and meshlm/hf_gpt2.py (NOTE [HF GPT-2 tensors]).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import struct
from typing import Any, Optional

import torch
from torch import Tensor, nn

from meshlm.errors import CheckpointError, ConfigError
from meshlm.hf_llama import config_from_hf as hf_config_to_llama
from meshlm.hf_llama import config_to_hf as llama_to_hf_config
from meshlm.hf_llama import hf_name
from meshlm.lowering import local_box
from meshlm.precision import DTYPES as _DTYPES

__all__ = [
    "load_hf",
    "save_hf",
    "export_checkpoint",
    "import_hf",
    "convert_main",
    "read_hf_config",
    "hf_config_to_llama",
    "llama_to_hf_config",
    "hf_name",
]

_DT_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}

# model_type in config.json -> the module that knows that architecture's names, shapes and
# config (``hf_tensor``, ``read_block``, ``write_blocks``, ``config_from_hf``, ...).
_FAMILIES = {"llama": "meshlm.hf_llama", "gpt2": "meshlm.hf_gpt2"}


def _family(model_type: str, source: str):
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"{source}: model_type={model_type!r}; meshlm imports Hugging Face "
            f"{' and '.join(_FAMILIES)} models (meshlm.models.Llama, meshlm.models.GPT2)"
        )
    return importlib.import_module(_FAMILIES[model_type])


def _family_of(model: nn.Module):
    """The family of a meshlm model (by the class of its ``cfg``)."""
    cfg = getattr(model, "cfg", None)
    for mt in _FAMILIES:
        fam = _family(mt, "")
        if isinstance(cfg, fam.config_class()):
            return fam
    raise CheckpointError(
        f"{type(model).__name__}: meshlm exports its Llama and GPT2 to Hugging Face form "
        "(a model with a LlamaConfig or GPT2Config as .cfg), not this model"
    )


def _family_of_class(name: str):
    """The family whose meshlm class is ``name`` (a checkpoint's meta.json ``model.class``)."""
    for mt in _FAMILIES:
        fam = _family(mt, "")
        if fam.CLASS == name:
            return fam
    raise CheckpointError(f"the checkpoint holds a {name}; meshlm exports its Llama and GPT2 to Hugging Face form only")


def _strip(path: str) -> str:
    return path[3:] if path.startswith("hf:") else path


def _read_config(path: str):
    """(family, meshlm config) of the Hugging Face directory ``path``."""
    path = _strip(path)
    f = os.path.join(path, "config.json")
    try:
        with open(f) as fh:
            hf = json.load(fh)
        fam = _family(hf.get("model_type", "llama"), f)
        return fam, fam.config_from_hf(hf, f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{f}: missing; a Hugging Face model directory holds config.json and "
            "model.safetensors (or model.safetensors.index.json, or pytorch_model.bin)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: not a Hugging Face Llama or GPT-2 config ({type(e).__name__}: {e})") from None


def read_hf_config(path: str):
    """The meshlm config (LlamaConfig or GPT2Config) of a Hugging Face directory."""
    return _read_config(path)[1]


# --------------------------------------------------------------------------- local boxes
def _owns_replica(mesh, pls) -> bool:
    """This rank writes its block: the first replica along every replicated mesh axis."""
    return all(p.is_shard() or mesh.get_local_rank(i) == 0 for i, p in enumerate(pls))


# --------------------------------------------------------------------------- import
class _HFReader:
    """Tensor name -> block reader over the weights of an HF directory: model.safetensors,
    sharded safetensors with their index, or pytorch_model.bin (memory-mapped).  Names are
    the family's ``canonical`` ones."""

    _FORMS = (
        ("model.safetensors.index.json", True),
        ("model.safetensors", True),
        ("pytorch_model.bin.index.json", False),
        ("pytorch_model.bin", False),
    )

    def __init__(self, path: str, canonical=lambda n: n):
        self.path = path
        self._files: dict[str, Any] = {}
        form = next(((f, st) for f, st in self._FORMS if os.path.isfile(os.path.join(path, f))), None)
        if form is None:
            raise CheckpointError(f"{path}: no weights: none of {', '.join(f for f, _ in self._FORMS)}")
        name, self._safetensors = form
        full = os.path.join(path, name)
        if name.endswith(".index.json"):
            with open(full) as fh:
                files = json.load(fh)["weight_map"]
            files = {k: os.path.join(path, v) for k, v in files.items()}
        else:
            files = {k: full for k in self._keys(full)}
        self._loc = {canonical(k): (f, k) for k, f in files.items()}

    def _keys(self, f: str) -> list[str]:
        h = self._handle(f)
        return list(h.keys())

    def _handle(self, f: str):
        if f not in self._files:
            try:
                if self._safetensors:
                    from safetensors import safe_open

                    self._files[f] = safe_open(f, framework="pt")
                else:
                    self._files[f] = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001
                kind = "safetensors" if self._safetensors else "a torch state dict"
                raise CheckpointError(f"{f}: cannot open as {kind} ({type(e).__name__}: {e})") from None
        return self._files[f]

    def names(self) -> set[str]:
        return set(self._loc)

    def read(self, name: str, hf_shape_: tuple[int, ...], box_hf: list[tuple[int, int]]) -> Tensor:
        if name not in self._loc:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        f, key = self._loc[name]
        h = self._handle(f)
        if key not in h.keys():
            raise CheckpointError(f"{f}: has no tensor {key!r}")
        sl = h.get_slice(key) if self._safetensors else h[key]
        shape = tuple(sl.get_shape()) if self._safetensors else tuple(sl.shape)
        if shape != tuple(hf_shape_):
            raise CheckpointError(f"{f}: tensor {key!r} has shape {shape} but config.json implies {tuple(hf_shape_)}")
        idx = tuple(slice(s, s + n) for s, n in box_hf)
        return sl[idx]


def _check_names(path: str, fam, cfg, model: nn.Module, reader: _HFReader) -> None:
    """Every parameter of ``model`` is in the files, and every tensor of the files is a
    parameter (or one the family knows to skip)."""
    from meshlm.lowering import iter_params

    want = {fam.hf_tensor(cfg, fqn, tuple(p.shape))[0]: fqn for fqn, _m, _n, p in iter_params(model)}
    have = reader.names()
    missing = sorted(set(want) - have)
    if missing:
        raise CheckpointError(
            f"{path}: has no tensor {missing[0]!r} (meshlm's `{want[missing[0]]}`; "
            f"{len(missing)} missing), which config.json implies: the weights are of "
            "another model, or config.json does not describe them"
        )
    unknown = sorted(n for n in have - set(want) if not fam.is_extra(cfg, n))
    if unknown:
        raise CheckpointError(
            f"{path}: tensor {unknown[0]!r} ({len(unknown)} unknown) is no parameter of "
            f"meshlm's {fam.CLASS} as config.json describes it: the weights are of another "
            "model, or config.json (e.g. its layer count) does not describe them"
        )


def model_of(path: str) -> nn.Module:
    """The meshlm model (on the meta device, no weights) of the Hugging Face directory
    ``path``: what :func:`load_hf` fills, for planning it."""
    fam, cfg = _read_config(_strip(path))
    return fam.build(cfg)


def load_hf(path: str, layout: Any, mesh: Any, *, seed: int = 0, **shard_kwargs: Any) -> nn.Module:
    """The meshlm model of the Hugging Face directory ``path`` (``hf:`` prefix allowed;
    ``model_type`` ``llama`` or ``gpt2``) sharded under ``layout`` on ``mesh``, with its
    weights.  Each rank reads only its own blocks from the files.  ``shard_kwargs`` go to
    :func:`meshlm.shard`."""
    from meshlm.lowering import iter_params, shard

    path = _strip(path)
    fam, cfg = _read_config(path)
    reader = _HFReader(path, fam.canonical)
    model = fam.build(cfg)
    _check_names(path, fam, cfg, model, reader)
    # Each rank allocates its shards uninitialised and reads exactly those blocks below.
    model = shard(model, layout, mesh, init=False, **shard_kwargs)
    with torch.no_grad():
        for fqn, _m, _n, p in iter_params(model):
            local = p.to_local()
            box = local_box(tuple(p.shape), p.device_mesh, p.placements)
            block = fam.read_block(reader.read, cfg, fqn, tuple(p.shape), box)
            if tuple(block.shape) != tuple(local.shape):
                raise CheckpointError(
                    f"{path}: block of `{fqn}` has shape {tuple(block.shape)}, expected {tuple(local.shape)}"
                )
            local.copy_(block.to(local.dtype))
    return model


# --------------------------------------------------------------------------- export
def _st_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict) -> tuple[bytes, dict[str, int]]:
    """safetensors header bytes and each tensor's absolute byte offset in the file."""
    head: dict[str, Any] = {"__metadata__": metadata}
    offsets, off = {}, 0
    for name, dt, shape, nbytes in entries:
        head[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        offsets[name] = off
        off += nbytes
    js = json.dumps(head, separators=(",", ":")).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    base = 8 + len(js)
    return struct.pack("<Q", len(js)) + js, {k: v + base for k, v in offsets.items()}


def _write_block(fd: int, file_off: int, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor) -> None:
    """pwrite a row-major block ``local`` at ``box`` of a tensor of ``shape`` starting at
    ``file_off``: one contiguous run per index of the dims before the last partial one."""
    local = local.contiguous()
    esz = local.element_size()
    nd = len(shape)
    j = max((d for d in range(nd) if box[d][1] != shape[d]), default=-1)
    data = local.reshape(-1).view(torch.uint8).numpy() if local.numel() else None
    if data is None:
        return
    if j < 0:
        os.pwrite(fd, data.tobytes(), file_off)
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = box[j][1] * strides[j] * esz
    lead = [range(box[d][1]) for d in range(j)]
    rows = data.reshape(-1, run)
    import itertools

    for r, idx in enumerate(itertools.product(*lead)):
        start = sum((box[d][0] + idx[d]) * strides[d] for d in range(j)) + box[j][0] * strides[j]
        os.pwrite(fd, rows[r].tobytes(), file_off + start * esz)


def save_hf(model: nn.Module, out: str, *, dtype: Optional[torch.dtype] = None) -> str:
    """Write ``model`` (a meshlm Llama or GPT2, sharded or plain) as a Hugging Face
    directory: ``config.json`` + one consolidated ``model.safetensors``.  Collective when
    the model is sharded; each rank writes only the blocks it stores (one replica each)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshlm.lowering import iter_params

    fam, cfg = _family_of(model), model.cfg
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    params = [(fqn, p) for fqn, _m, _n, p in iter_params(model)]
    dt = dtype or params[0][1].dtype
    config = fam.config_to_hf(cfg, dt)  # raises, on every rank, before anything is written
    names = {fqn: fam.hf_tensor(cfg, fqn, tuple(p.shape)) for fqn, p in params}
    entries = sorted((*names[fqn], math.prod(p.shape) * torch.empty((), dtype=dt).element_size()) for fqn, p in params)
    header, offsets = _st_header([(n, _DT_TO_ST[dt], s, b) for n, s, b in entries], {"format": "pt"})
    total = len(header) + sum(e[2] for e in entries)
    fname = os.path.join(out, "model.safetensors")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh, indent=1)
        with open(fname, "wb") as fh:
            fh.write(header)
            fh.truncate(total)
    if distributed:
        dist.barrier()
    fd = os.open(fname, os.O_WRONLY)
    try:
        with torch.no_grad():
            for fqn, p in params:
                shape = tuple(p.shape)
                if isinstance(p, DTensor):
                    if not _owns_replica(p.device_mesh, p.placements):
                        continue
                    local, box = p.to_local(), local_box(shape, p.device_mesh, p.placements)
                elif rank == 0:
                    local, box = p.detach(), [(0, n) for n in shape]
                else:
                    continue
                for hs, hbox, block in fam.write_blocks(cfg, fqn, shape, box, local.to(dt)):
                    _write_block(fd, offsets[names[fqn][0]], hs, hbox, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    if distributed:
        dist.barrier()
    return out


def _model_for_checkpoint(ckpt: str, layout: str, mesh_shape: Optional[str]):
    import torch.distributed as dist

    from meshlm.checkpoint import read_meta, resolve_path
    from meshlm.lowering import shard
    from meshlm.mesh import make_mesh

    ckpt = resolve_path(ckpt)
    meta = read_meta(ckpt)
    cfgd = meta.get("model", {}).get("config")
    if not cfgd:
        raise CheckpointError(f"{ckpt}/meta.json: has no model config; cannot rebuild the model to export it")
    fam = _family_of_class(meta["model"].get("class", "Llama"))
    cfg = fam.config_class()(**cfgd)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    mesh = make_mesh(mesh_shape or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = shard(fam.build(cfg), layout if world > 1 or mesh_shape else "single", mesh)
    return ckpt, model


def export_checkpoint(
    ckpt: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> str:
    """Export a meshlm training checkpoint (a ``step_*`` directory, or a run directory: its
    latest) to a Hugging Face directory.  Run under torchrun to split the work: every rank
    loads and writes only its ``layout`` shard of each tensor."""
    from meshlm.checkpoint import load_checkpoint

    ckpt, model = _model_for_checkpoint(ckpt, layout, mesh)
    load_checkpoint(ckpt, model=model, optimizer=None, restore_rng=False)
    return save_hf(model, out, dtype=dtype)


def import_hf(path: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None) -> str:
    """Convert a Hugging Face Llama or GPT-2 directory to a meshlm checkpoint (step 0, weights only)."""
    import torch.distributed as dist

    from meshlm.checkpoint import CheckpointConfig, Checkpointer
    from meshlm.mesh import make_mesh

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    m = make_mesh(mesh or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = load_hf(path, layout if world > 1 or mesh else "single", m)
    # a run of its own (step 0): `meshlm train checkpoint.dir=OUT checkpoint.resume=auto` continues it
    ck = Checkpointer(CheckpointConfig(dir=out, keep=0), model=model, run_meta={"converted_from": _strip(path)})
    return ck.save(0, {"step": 0, "init_from": f"hf:{_strip(path)}"})


def convert_main(argv: list[str]) -> int:
    """``meshlm convert SRC DST``: a Hugging Face Llama or GPT-2 directory -> a meshlm checkpoint under
    DST, or a meshlm checkpoint (or run directory) -> a Hugging Face directory DST.  The
    direction follows SRC (``config.json`` = Hugging Face).  Under torchrun every rank
    handles only its shard."""
    p = argparse.ArgumentParser(prog="meshlm convert", description=convert_main.__doc__)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", default="fsdp", help="layout used while converting (under torchrun)")
    p.add_argument("--mesh", default=None, help="mesh while converting, e.g. fsdp=4 (default: fsdp=world size)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="dtype of the exported safetensors")
    a = p.parse_args(argv)
    src = _strip(a.src)
    try:
        if os.path.isfile(os.path.join(src, "config.json")):
            out = import_hf(src, a.dst, layout=a.layout, mesh=a.mesh)
            what = "meshlm checkpoint"
        else:
            out = export_checkpoint(src, a.dst, layout=a.layout, mesh=a.mesh, dtype=_DTYPES.get(a.dtype or ""))
            what = "Hugging Face directory"
    except (CheckpointError, ConfigError) as e:
        import sys

        print(f"meshlm convert: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {what} {out}")
    return 0
