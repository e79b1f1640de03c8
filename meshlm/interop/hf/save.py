"""A sharded meshlm model -> a Hugging Face directory, with no full model on any rank:
:func:`save_hf` writes ``config.json`` and one consolidated ``model.safetensors`` that
``transformers`` loads.  Rank 0 writes the header, then every rank ``pwrite``s the blocks it
owns (one replica of each) straight to their offsets."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Optional

import torch
from torch import Tensor, nn

from meshlm.interop.hf.family import _family_of, hf_tensors, write_blocks
from meshlm.runtime.lowering import local_box

_DT_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _owns_replica(mesh, pls) -> bool:
    """This rank writes its block: the first replica along every replicated mesh axis."""
    return all(p.is_shard() or mesh.get_local_rank(i) == 0 for i, p in enumerate(pls))


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


def faithful_config(derived: dict, source: Optional[dict]) -> dict:
    """NOTE [faithful config]
    ``config.json`` of an export: the keys the architecture fixes, from the model
    (``config_to_hf``), over every key of the config the model came from (``source``: the
    Hugging Face ``config.json`` a run started from, NOTE [run tokenizer] in
    meshlm/train/checkpoint/assets.py), so its special-token ids (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``), ``max_position_embeddings`` and anything else it
    says survive the round trip; without a source, the model's keys alone."""
    if not source:
        return dict(derived)
    keep = {"max_position_embeddings"}  # not fixed by the weights: the source's word stands
    return {**source, **{k: v for k, v in derived.items() if k not in keep or k not in source}}


def generation_config(config: dict, source: Optional[dict]) -> dict:
    """``generation_config.json``: the source's, else the special-token ids of ``config``."""
    if source:
        return dict(source)
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {"_from_model_config": True, **out}


def save_hf(
    model: nn.Module,
    out: str,
    *,
    dtype: Optional[torch.dtype] = None,
    source_config: Optional[dict] = None,
    source_generation: Optional[dict] = None,
) -> str:
    """Write ``model`` (a meshlm Llama, GPT2, VLM or MoETransformer, sharded or plain) as a Hugging Face
    directory: ``config.json`` (NOTE [faithful config]: ``source_config`` is the config the
    model came from), ``generation_config.json`` (``source_generation``, else the config's
    special-token ids) and one consolidated ``model.safetensors``.  Collective when the
    model is sharded; each rank writes only the blocks it stores (one replica each)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshlm.runtime.lowering import iter_params

    fam, cfg = _family_of(model), model.cfg
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    params = [(fqn, p) for fqn, _m, _n, p in iter_params(model)]
    dt = dtype or params[0][1].dtype
    config = faithful_config(fam.config_to_hf(cfg, dt), source_config)  # raises, on every rank, before any write
    if hasattr(fam, "check_export"):
        fam.check_export(model)
    esz = torch.empty((), dtype=dt).element_size()
    entries = sorted(
        (n, s, math.prod(s) * esz) for fqn, p in params for n, s in hf_tensors(fam, cfg, fqn, tuple(p.shape))
    )
    header, offsets = _st_header([(n, _DT_TO_ST[dt], s, b) for n, s, b in entries], {"format": "pt"})
    total = len(header) + sum(e[2] for e in entries)
    fname = os.path.join(out, "model.safetensors")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh, indent=1)
        with open(os.path.join(out, "generation_config.json"), "w") as fh:
            json.dump(generation_config(config, source_generation), fh, indent=1)
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
                for name, hs, hbox, block in write_blocks(fam, cfg, fqn, shape, box, local.to(dt)):
                    _write_block(fd, offsets[name], hs, hbox, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    if distributed:
        dist.barrier()
    return out
