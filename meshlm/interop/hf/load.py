"""Hugging Face weights -> a sharded meshlm model, with no full model on any rank:
:func:`load_hf` reads ``config.json`` and ``model.safetensors`` (or sharded files and
``model.safetensors.index.json``, or ``pytorch_model.bin``) into the meshlm model its
``model_type`` names, sharded under any layout; each rank reads only the block of each tensor
it stores (``safe_open(...).get_slice``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError
from meshlm.interop.hf.family import _read_config, hf_tensors, strip_scheme
from meshlm.runtime.lowering import local_box


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
    from meshlm.runtime.lowering import iter_params

    want = {n: fqn for fqn, _m, _n, p in iter_params(model) for n, _s in hf_tensors(fam, cfg, fqn, tuple(p.shape))}
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


def _fill_buffers(fam, module: nn.Module) -> None:
    """The buffers the files do not hold, as the family's architecture has them (a
    MoE's ``selection_bias``: zero); the rest are the model's own."""
    if hasattr(fam, "fill_buffers"):
        fam.fill_buffers(module)


def model_of(path: str) -> nn.Module:
    """The meshlm model (on the meta device, no weights) of the Hugging Face directory
    ``path``: what :func:`load_hf` fills, for planning it."""
    fam, cfg = _read_config(strip_scheme(path))
    return fam.build(cfg)


def load_hf(
    path: str, layout: Any, mesh: Any, *, seed: int = 0, after_block: Any = None, **shard_kwargs: Any
) -> nn.Module:
    """The meshlm model of the Hugging Face directory ``path`` (``hf:`` prefix allowed;
    ``model_type`` ``llama``, ``gpt2``, ``llava`` or ``mixtral``) sharded under ``layout`` on ``mesh``, with its
    weights.  Each rank reads only its own blocks from the files.  ``after_block(block)``:
    as :func:`meshlm.shard`'s, called once each outer block's shards are made and read (so
    ``meshlm train`` builds an offloaded model onto its tier from the files too, never whole
    in memory).  ``shard_kwargs`` go to :func:`meshlm.shard`."""
    from meshlm.runtime.lowering import iter_params, shard

    path = strip_scheme(path)
    fam, cfg = _read_config(path)
    reader = _HFReader(path, fam.canonical)
    model = fam.build(cfg)
    _check_names(path, fam, cfg, model, reader)
    names = {id(m): n for n, m in model.named_modules()}
    done: set[int] = set()

    def read(fqn: str, p: Any) -> None:
        local = p.to_local()
        box = local_box(tuple(p.shape), p.device_mesh, p.placements)
        block = fam.read_block(reader.read, cfg, fqn, tuple(p.shape), box)
        if tuple(block.shape) != tuple(local.shape):
            raise CheckpointError(
                f"{path}: block of `{fqn}` has shape {tuple(block.shape)}, expected {tuple(local.shape)}"
            )
        local.copy_(block.to(local.dtype))
        done.add(id(p))

    def on_block(blk: nn.Module) -> None:
        with torch.no_grad():
            for sub in blk.modules():
                for n, p in sub._parameters.items():
                    if p is not None and id(p) not in done:
                        read(f"{names[id(sub)]}.{n}", p)
        _fill_buffers(fam, blk)
        after_block(blk)

    # Each rank allocates its shards uninitialised and reads exactly its blocks.
    model = shard(model, layout, mesh, init=False, after_block=on_block if after_block else None, **shard_kwargs)
    with torch.no_grad():
        for fqn, _m, _n, p in iter_params(model):
            if id(p) not in done:
                read(fqn, p)
    _fill_buffers(fam, model)
    return model


def load_hf_local(path: str, after_block: Any = None, keep: Any = None) -> nn.Module:
    """The meshlm model of the Hugging Face directory ``path`` on this process's CPU,
    unsharded (no process group): for one-device inference and tests.  ``after_block(i,
    block)`` is called once outer block ``i``'s parameters are read (before the next
    block's): inference placement moves streamed blocks to their tier there.  ``keep(i)``
    false: block ``i`` stays on the meta device, unread (another rank runs it, NOTE
    [staged decoding] in meshlm/infer/stages.py)."""
    from meshlm.core.annotate import outer_blocks
    from meshlm.core.ties import aliases
    from meshlm.runtime.lowering import iter_params

    path = strip_scheme(path)
    fam, cfg = _read_config(path)
    reader = _HFReader(path, fam.canonical)
    model = fam.build(cfg)
    _check_names(path, fam, cfg, model, reader)
    tied = aliases(model)
    blocks = outer_blocks(model)
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    for m in model.modules():  # each slot of a tied parameter gets its own tensor here:
        if id(m) not in in_blocks:
            m.to_empty(device="cpu", recurse=False)
    for i, b in enumerate(blocks):
        if keep is None or keep(i):
            b.to_empty(device="cpu")
    for m, name, first, first_name in tied:  # tie them again (NOTE [ties])
        setattr(m, name, getattr(first, first_name))
    names = {id(p): fqn for fqn, _m, _n, p in iter_params(model)}
    done: set[int] = set()

    def read(params) -> None:
        for p in params:
            if id(p) in names and id(p) not in done and p.device.type != "meta":
                full = [(0, n) for n in p.shape]
                p.copy_(fam.read_block(reader.read, cfg, names[id(p)], tuple(p.shape), full).to(p.dtype))
                done.add(id(p))

    with torch.no_grad():
        for i, blk in enumerate(blocks):
            read(blk.parameters())
            _fill_buffers(fam, blk)
            if after_block is not None:
                after_block(i, blk)
        read(model.parameters())
    _fill_buffers(fam, model)
    return model.eval()
