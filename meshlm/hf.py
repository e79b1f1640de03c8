"""Hugging Face Llama safetensors <-> sharded meshlm Llama, with no full model on any rank.

* :func:`load_hf` reads ``config.json`` and ``model.safetensors`` (or sharded files and
  ``model.safetensors.index.json``) into a meshlm Llama sharded under any layout: each
  rank reads only the block of each tensor it stores (``safe_open(...).get_slice``).
* :func:`save_hf` writes a live sharded model as a Hugging Face directory
  (``config.json`` + one consolidated ``model.safetensors``) that ``transformers`` loads:
  rank 0 writes the header, then every rank ``pwrite``s the blocks it owns (one replica of
  each) straight to their offsets, so no rank ever holds the whole model.
* :func:`export_checkpoint` does that for a training checkpoint (``meshlm convert``).

NOTE [HF names]: meshlm stores attention weights per head, ``wq: (heads, head_dim, embed)``
and ``wo: (embed, heads, head_dim)``; HF's ``q_proj: (heads*head_dim, embed)`` and
``o_proj: (embed, heads*head_dim)`` are row-major reshapes of them, so the bytes are the
same and only the shape in the safetensors header differs.  Both use the rotate-half RoPE
convention (HF checkpoints are already permuted for it), so no permutation is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from typing import Any, Optional

import torch
from torch import Tensor, nn

from meshlm.errors import CheckpointError, ConfigError
from meshlm.lower import local_box

__all__ = ["load_hf", "save_hf", "export_checkpoint", "import_hf", "convert_main", "hf_config_to_llama",
           "llama_to_hf_config", "hf_name"]

_DT_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}
_TOP = {"tok_emb": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "norm.weight": "model.norm.weight"}


def hf_name(fqn: str) -> str:
    """The Hugging Face tensor name of a meshlm parameter FQN (NOTE [HF names])."""
    if fqn in _TOP:
        return _TOP[fqn]
    parts = fqn.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise CheckpointError(f"parameter `{fqn}` has no Hugging Face Llama name")


def hf_shape(fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF's shape for a meshlm parameter of ``shape``: per-head dims merged."""
    if fqn.endswith(("attn.wq", "attn.wk", "attn.wv")):
        return (shape[0] * shape[1], shape[2])
    if fqn.endswith("attn.wo"):
        return (shape[0], shape[1] * shape[2])
    return tuple(shape)


# --------------------------------------------------------------------------- configs
def hf_config_to_llama(hf: dict, source: str = "config.json"):
    """meshlm LlamaConfig from a Hugging Face Llama ``config.json`` dict."""
    from meshlm.models.llama import LlamaConfig

    mt = hf.get("model_type", "llama")
    if mt != "llama":
        raise ConfigError(f"{source}: model_type={mt!r}; meshlm imports Hugging Face Llama models only")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{source}: {flag}=true; meshlm's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={hf['hidden_act']!r}; meshlm's Llama uses SwiGLU (silu)")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rtype = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rtype not in (None, "default"):
        raise ConfigError(f"{source}: rope type {rtype!r} is not supported (meshlm implements default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    embed = hf["hidden_size"]
    hd = hf.get("head_dim") or embed // heads
    return LlamaConfig(
        vocab=hf["vocab_size"], embed=embed, layers=hf["num_hidden_layers"], heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, mlp=hf["intermediate_size"],
        head_dim=None if hd == embed // heads else hd, rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def llama_to_hf_config(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face ``config.json`` dict for a meshlm LlamaConfig."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.mlp,
        "head_dim": cfg.hd, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": 4096, "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
    }


def _strip(path: str) -> str:
    return path[3:] if path.startswith("hf:") else path


def read_hf_config(path: str):
    path = _strip(path)
    f = os.path.join(path, "config.json")
    try:
        with open(f) as fh:
            return hf_config_to_llama(json.load(fh), f)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; a Hugging Face model directory holds config.json and "
                              "model.safetensors (or model.safetensors.index.json)") from None
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{f}: not a Hugging Face Llama config ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- local boxes
def _owns_replica(mesh, pls) -> bool:
    """This rank writes its block: the first replica along every replicated mesh axis."""
    return all(p.is_shard() or mesh.get_local_rank(i) == 0 for i, p in enumerate(pls))


# --------------------------------------------------------------------------- import
class _HFReader:
    """Tensor name -> slice reader over model.safetensors or its sharded files."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as fh:
                self.weight_map = json.load(fh)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = None
        else:
            raise CheckpointError(f"{path}: no model.safetensors nor model.safetensors.index.json")
        self._open = safe_open
        self._files: dict[str, Any] = {}
        self._single = single

    def _file(self, name: str):
        f = self._single if self.weight_map is None else os.path.join(self.path, self.weight_map.get(name, ""))
        if self.weight_map is not None and name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in model.safetensors.index.json")
        if f not in self._files:
            try:
                self._files[f] = self._open(f, framework="pt")
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{f}: cannot open as safetensors ({type(e).__name__}: {e})") from None
        return f, self._files[f]

    def read(self, name: str, hf_shape_: tuple[int, ...], box_hf: list[tuple[int, int]]) -> Tensor:
        f, h = self._file(name)
        if name not in h.keys():
            raise CheckpointError(f"{f}: has no tensor {name!r}")
        sl = h.get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(hf_shape_):
            raise CheckpointError(f"{f}: tensor {name!r} has shape {shape} but config.json implies {tuple(hf_shape_)}")
        idx = tuple(slice(s, s + n) for s, n in box_hf)
        return sl[idx]


def _read_block(reader: _HFReader, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (in meshlm's shape) of parameter ``fqn``, read from the HF files."""
    name = hf_name(fqn)
    hs = hf_shape(fqn, shape)
    if fqn.endswith(("attn.wq", "attn.wk", "attn.wv")):
        (h0, hn), (d0, dn), (e0, en) = box
        hd = shape[1]
        t = reader.read(name, hs, [(h0 * hd, hn * hd), (e0, en)])
        return t.reshape(hn, hd, en)[:, d0:d0 + dn]
    if fqn.endswith("attn.wo"):
        (e0, en), (h0, hn), (d0, dn) = box
        hd = shape[2]
        t = reader.read(name, hs, [(e0, en), (h0 * hd, hn * hd)])
        return t.reshape(en, hn, hd)[:, :, d0:d0 + dn]
    return reader.read(name, hs, box)


def load_hf(path: str, layout: Any, mesh: Any, *, seed: int = 0, **shard_kwargs: Any) -> nn.Module:
    """A meshlm Llama sharded under ``layout`` on ``mesh``, with the weights of the Hugging
    Face Llama directory ``path`` (``hf:`` prefix allowed).  Each rank reads only its own
    blocks from the safetensors files.  ``shard_kwargs`` go to :func:`meshlm.shard`."""
    import meshlm
    from meshlm.lower import iter_params
    from meshlm.models.llama import Llama

    path = _strip(path)
    cfg = read_hf_config(path)
    reader = _HFReader(path)
    # Each rank allocates its shards uninitialised and reads exactly those blocks below.
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, init=False, **shard_kwargs)
    with torch.no_grad():
        for fqn, _m, _n, p in iter_params(model):
            local = p.to_local()
            box = local_box(tuple(p.shape), p.device_mesh, p.placements)
            block = _read_block(reader, fqn, tuple(p.shape), box)
            if tuple(block.shape) != tuple(local.shape):
                raise CheckpointError(f"{path}: block of `{fqn}` has shape {tuple(block.shape)}, expected {tuple(local.shape)}")
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
    strides = [math.prod(shape[d + 1:]) for d in range(nd)]
    run = box[j][1] * strides[j] * esz
    lead = [range(box[d][1]) for d in range(j)]
    rows = data.reshape(-1, run)
    import itertools

    for r, idx in enumerate(itertools.product(*lead)):
        start = sum((box[d][0] + idx[d]) * strides[d] for d in range(j)) + box[j][0] * strides[j]
        os.pwrite(fd, rows[r].tobytes(), file_off + start * esz)


def save_hf(model: nn.Module, out: str, *, dtype: Optional[torch.dtype] = None) -> str:
    """Write ``model`` (a sharded meshlm Llama, or a plain one) as a Hugging Face Llama
    directory: ``config.json`` + one consolidated ``model.safetensors``.  Collective when
    the model is sharded; each rank writes only the blocks it stores (one replica each)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshlm.lower import iter_params

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    params = [(fqn, p) for fqn, _m, _n, p in iter_params(model)]
    dt = dtype or params[0][1].dtype
    entries = sorted((hf_name(fqn), _DT_TO_ST[dt], hf_shape(fqn, tuple(p.shape)),
                      math.prod(p.shape) * torch.empty((), dtype=dt).element_size()) for fqn, p in params)
    header, offsets = _st_header(entries, {"format": "pt"})
    total = len(header) + sum(e[3] for e in entries)
    fname = os.path.join(out, "model.safetensors")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(llama_to_hf_config(model.cfg, dt), fh, indent=1)
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
                _write_block(fd, offsets[hf_name(fqn)], shape, box, local.to(dt))
        os.fsync(fd)
    finally:
        os.close(fd)
    if distributed:
        dist.barrier()
    return out


def _model_for_checkpoint(ckpt: str, layout: str, mesh_shape: Optional[str]):
    import torch.distributed as dist

    import meshlm
    from meshlm.checkpoint import read_meta, resolve_path
    from meshlm.models.llama import Llama, LlamaConfig

    ckpt = resolve_path(ckpt)
    meta = read_meta(ckpt)
    cfgd = meta.get("model", {}).get("config")
    if not cfgd:
        raise CheckpointError(f"{ckpt}/meta.json: has no model config; cannot rebuild the model to export it")
    cfg = LlamaConfig(**cfgd)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    mesh = meshlm.make_mesh(mesh_shape or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = meshlm.shard(Llama(cfg, device="meta"), layout if world > 1 or mesh_shape else "single", mesh)
    return ckpt, model


def export_checkpoint(ckpt: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None) -> str:
    """Export a meshlm training checkpoint (a ``step_*`` directory, or a run directory: its
    latest) to a Hugging Face directory.  Run under torchrun to split the work: every rank
    loads and writes only its ``layout`` shard of each tensor."""
    from meshlm.checkpoint import load_checkpoint

    ckpt, model = _model_for_checkpoint(ckpt, layout, mesh)
    load_checkpoint(ckpt, model=model, optimizer=None, restore_rng=False)
    return save_hf(model, out, dtype=dtype)


def import_hf(path: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None) -> str:
    """Convert a Hugging Face Llama directory to a meshlm checkpoint (step 0, weights only)."""
    import torch.distributed as dist

    import meshlm
    from meshlm.checkpoint import CheckpointConfig, Checkpointer

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    m = meshlm.make_mesh(mesh or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = load_hf(path, layout if world > 1 or mesh else "single", m)
    # a run of its own (step 0): `meshlm train checkpoint.dir=OUT checkpoint.resume=auto` continues it
    ck = Checkpointer(CheckpointConfig(dir=out, keep=0), model=model, run_meta={"converted_from": _strip(path)})
    return ck.save(0, {"step": 0, "init_from": f"hf:{_strip(path)}"})


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def convert_main(argv: list[str]) -> int:
    """``meshlm convert SRC DST``: a Hugging Face Llama directory -> a meshlm checkpoint under
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
