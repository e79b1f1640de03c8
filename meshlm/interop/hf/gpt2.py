"""Hugging Face GPT-2 <-> meshlm GPT2: names, shapes and configs (the ``gpt2`` family of
meshlm/interop/hf/__init__.py; the reading and writing machinery is meshlm/interop/hf/load.py and meshlm/interop/hf/save.py).

NOTE [HF GPT-2 tensors]
    Names are the same on both sides (``transformer.h.0.attn.c_attn.weight``); a file saved
    from HF's headless ``GPT2Model`` lacks the ``transformer.`` prefix and is read the same.
    Values differ in two ways, undone block by block so no rank reads or writes more than
    its own shard:
    - HF's ``Conv1D`` (``c_attn``, ``c_proj``, ``c_fc``) stores its weight ``(in, out)``,
      the transpose of ``nn.Linear``'s ``(out, in)``: a block of rows of meshlm's weight is a
      block of columns of HF's.
    - HF's ``c_attn`` output is ordered ``(3, heads, head_dim)`` (all queries, then keys,
      then values), meshlm's ``(heads, 3, head_dim)`` (NOTE [fused QKV] in
      meshlm/models/gpt2.py): meshlm's output row ``(h, t, d)`` is HF's column ``t * embed +
      h * head_dim + d``, so a block of rows is a few runs of HF columns, at most one per
      head and q/k/v (``_qkv_runs``).
    With ``tie_word_embeddings`` (GPT-2's default) the head is ``transformer.wte.weight``
    and no ``lm_head.weight`` is written; the causal-mask buffers older files hold
    (``attn.bias``, ``attn.masked_bias``) are skipped.  Dropout rates (``*_pdrop``) are
    training choices, not weights: importing leaves ``dropout`` at 0 (set ``model.dropout``
    to train with it), exporting writes ``dropout`` as ``resid_pdrop`` and ``embd_pdrop``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from meshlm.core.errors import ConfigError

MODEL_TYPE = "gpt2"
CLASS = "GPT2"  # the meshlm class a checkpoint's meta.json names

_CONV = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # HF's names for the tanh approximation


def config_class():
    from meshlm.models.gpt2 import GPT2Config

    return GPT2Config


def build(cfg) -> nn.Module:
    from meshlm.models.gpt2 import GPT2

    return GPT2(cfg, device="meta")


def hf_tensor(cfg, fqn: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(HF name, HF shape) of the meshlm parameter ``fqn`` of ``shape``."""
    if fqn.endswith(_CONV):
        return fqn, (shape[1], shape[0])
    return fqn, tuple(shape)


def canonical(name: str) -> str:
    """The name of a tensor of an HF file as GPT2LMHeadModel names it."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def is_extra(cfg, name: str) -> bool:
    """A tensor an HF GPT-2 file may hold that is no meshlm parameter."""
    return name.endswith((".attn.bias", ".attn.masked_bias")) or (cfg.tie_embeddings and name == "lm_head.weight")


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm GPT2Config from a Hugging Face GPT-2 ``config.json`` dict."""
    mt = hf.get("model_type", "gpt2")
    if mt != "gpt2":
        raise ConfigError(f"{source}: model_type={mt!r}; this reads Hugging Face GPT-2 configs only")
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise ConfigError(
            f"{source}: activation_function={act!r}; meshlm's GPT-2 uses GELU with the tanh "
            f"approximation ({' or '.join(map(repr, _TANH_GELU))})"
        )
    for key, want, what in (
        ("scale_attn_weights", True, "scales attention scores by 1/sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", False, "does not scale attention by layer"),
        ("reorder_and_upcast_attn", False, "computes attention with SDPA in the model's dtype"),
        ("add_cross_attention", False, "is a decoder without cross-attention"),
    ):
        if bool(hf.get(key, want)) != want:
            raise ConfigError(f"{source}: {key}={hf[key]!r}, but meshlm's GPT-2 {what} ({key}={want} is supported)")
    try:
        return config_class()(
            vocab=hf["vocab_size"],
            block_size=hf["n_positions"],
            embed=hf["n_embd"],
            layers=hf["n_layer"],
            heads=hf["n_head"],
            mlp=hf.get("n_inner"),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face ``config.json`` dict for a meshlm GPT2Config."""
    if not cfg.bias:
        raise ConfigError(
            "model.bias=false: Hugging Face's GPT-2 has a bias in every Linear and LayerNorm, "
            "so a GPT-2 without biases has no Hugging Face form"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,
        "n_positions": cfg.block_size,
        "n_embd": cfg.embed,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": cfg.mlp,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


# --------------------------------------------------------------------------- blocks
Read = Callable[[str, tuple[int, ...], list[tuple[int, int]]], Tensor]


def _qkv_runs(r0: int, n: int, cfg) -> list[tuple[int, int, int]]:
    """(offset in the block, HF column, length) of the runs of HF ``c_attn`` columns that
    hold meshlm's rows ``r0 .. r0 + n`` (NOTE [HF GPT-2 tensors])."""
    hd, out = cfg.head_dim, []
    r, end = r0, r0 + n
    while r < end:
        g, d = divmod(r, hd)
        h, t = divmod(g, 3)
        ln = min(hd - d, end - r)
        col = t * cfg.embed + h * hd + d
        if out and out[-1][1] + out[-1][2] == col:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + ln)
        else:
            out.append((r - r0, col, ln))
        r += ln
    return out


def read_block(read: Read, cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (``box`` in meshlm's ``shape``) of parameter ``fqn``; ``read(name,
    hf_shape, hf_box)`` reads a block of an HF tensor."""
    name, hs = hf_tensor(cfg, fqn, shape)
    if fqn.endswith("attn.c_attn.weight"):
        (r0, rn), (i0, n_in) = box
        return torch.cat([read(name, hs, [(i0, n_in), (c, ln)]) for _o, c, ln in _qkv_runs(r0, rn, cfg)], 1).T
    if fqn.endswith("attn.c_attn.bias"):
        ((r0, rn),) = box
        return torch.cat([read(name, hs, [(c, ln)]) for _o, c, ln in _qkv_runs(r0, rn, cfg)])
    if fqn.endswith(_CONV):
        (o0, on), (i0, n_in) = box
        return read(name, hs, [(i0, n_in), (o0, on)]).T
    return read(name, hs, box)


def write_blocks(
    cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """(HF shape, HF box, block) to write for this rank's block ``local`` (at ``box``) of
    ``fqn``: the inverse of :func:`read_block`."""
    _name, hs = hf_tensor(cfg, fqn, shape)
    if fqn.endswith("attn.c_attn.weight"):
        (r0, rn), (i0, n_in) = box
        return [(hs, [(i0, n_in), (c, ln)], local[o : o + ln].T) for o, c, ln in _qkv_runs(r0, rn, cfg)]
    if fqn.endswith("attn.c_attn.bias"):
        ((r0, rn),) = box
        return [(hs, [(c, ln)], local[o : o + ln]) for o, c, ln in _qkv_runs(r0, rn, cfg)]
    if fqn.endswith(_CONV):
        (o0, on), (i0, n_in) = box
        return [(hs, [(i0, n_in), (o0, on)], local.T)]
    return [(hs, box, local)]
