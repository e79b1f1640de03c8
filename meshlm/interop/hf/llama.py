"""Hugging Face Llama <-> meshlm Llama: names, shapes and configs (the ``llama`` family of
meshlm/interop/hf/__init__.py; the reading and writing machinery is meshlm/interop/hf/load.py and meshlm/interop/hf/save.py).

NOTE [HF names]: meshlm stores attention weights per head, ``wq: (heads, head_dim, embed)``
and ``wo: (embed, heads, head_dim)``; HF's ``q_proj: (heads*head_dim, embed)`` and
``o_proj: (embed, heads*head_dim)`` are row-major reshapes of them, so the bytes are the
same and only the shape in the safetensors header differs; so are the biases ``bq: (heads,
head_dim)`` and HF's ``q_proj.bias: (heads*head_dim,)`` (Qwen's attention, with the per-head
``q_norm``/``k_norm`` of NOTE [HF Qwen-MoE tensors] in meshlm/interop/hf/qwen_moe.py).  Both use the rotate-half RoPE
convention (HF checkpoints are already permuted for it), so no permutation is needed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError, ConfigError

MODEL_TYPE = "llama"
CLASS = "Llama"  # the meshlm class a checkpoint's meta.json names

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}
_BIASES = ("attn.bq", "attn.bk", "attn.bv")
_TOP = {"tok_emb": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "norm.weight": "model.norm.weight"}


def config_class():
    from meshlm.models.llama import LlamaConfig

    return LlamaConfig


def build(cfg) -> nn.Module:
    from meshlm.models.llama import Llama

    return Llama(cfg, device="meta")


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
    if fqn.endswith(_BIASES):
        return (shape[0] * shape[1],)
    return tuple(shape)


def hf_tensor(cfg, fqn: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(HF name, HF shape) of the meshlm parameter ``fqn`` of ``shape``."""
    return hf_name(fqn), hf_shape(fqn, shape)


def canonical(name: str) -> str:
    """The name a tensor of an HF file is known by here (Llama: its own)."""
    return name


def is_extra(cfg, name: str) -> bool:
    """A tensor an HF Llama file may hold that is no meshlm parameter: the RoPE frequencies
    some older exports saved, and a tied head saved next to the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm LlamaConfig from a Hugging Face Llama ``config.json`` dict."""
    mt = hf.get("model_type", "llama")
    if mt != "llama":
        raise ConfigError(f"{source}: model_type={mt!r}; this reads Hugging Face Llama configs only")
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
    return config_class()(
        vocab=hf["vocab_size"],
        embed=embed,
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        mlp=hf["intermediate_size"],
        head_dim=None if hd == embed // heads else hd,
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face ``config.json`` dict for a meshlm LlamaConfig; Qwen's attention
    options (``qkv_bias``, ``qk_norm``), which Llama has not, are a ConfigError."""
    for field in ("qkv_bias", "qk_norm"):
        if getattr(cfg, field):
            raise ConfigError(f"model.{field}=True: cannot export as Hugging Face Llama (Llama's attention has none)")
    return attention_to_hf(cfg, dtype)


def attention_to_hf(cfg, dtype: torch.dtype) -> dict:
    """The ``config.json`` keys Llama's shape and attention fix (those of Qwen's are the
    caller's: meshlm/interop/hf/qwen_moe.py)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.embed,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "intermediate_size": cfg.mlp,
        "head_dim": cfg.hd,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


# --------------------------------------------------------------------------- blocks
Read = Callable[[str, tuple[int, ...], list[tuple[int, int]]], Tensor]


def read_block(read: Read, cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (``box`` in meshlm's ``shape``) of parameter ``fqn``; ``read(name,
    hf_shape, hf_box)`` reads a block of an HF tensor."""
    name, hs = hf_tensor(cfg, fqn, shape)
    if fqn.endswith(("attn.wq", "attn.wk", "attn.wv")):
        (h0, hn), (d0, dn), (e0, en) = box
        hd = shape[1]
        t = read(name, hs, [(h0 * hd, hn * hd), (e0, en)])
        return t.reshape(hn, hd, en)[:, d0 : d0 + dn]
    if fqn.endswith(_BIASES):
        (h0, hn), (d0, dn) = box
        hd = shape[1]
        return read(name, hs, [(h0 * hd, hn * hd)]).reshape(hn, hd)[:, d0 : d0 + dn]
    if fqn.endswith("attn.wo"):
        (e0, en), (h0, hn), (d0, dn) = box
        hd = shape[2]
        t = read(name, hs, [(e0, en), (h0 * hd, hn * hd)])
        return t.reshape(en, hn, hd)[:, :, d0 : d0 + dn]
    return read(name, hs, box)


def write_blocks(
    cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """(row-major shape, box, block) to write for this rank's block ``local`` of ``fqn``:
    the bytes are HF's in meshlm's shape (NOTE [HF names])."""
    return [(tuple(shape), box, local)]
