"""Hugging Face Qwen3-MoE <-> meshlm MoETransformer (the ``qwen3_moe`` family of
meshlm/interop/hf/__init__.py): Llama's attention with an RMSNorm over each head's query and
key (``qk_norm``), top-k of ``num_experts`` experts, no shared expert, the gates renormalised
with ``norm_topk_prob``.  Names and shapes: NOTE [HF Qwen-MoE tensors] in
meshlm/interop/hf/qwen_moe.py."""

from __future__ import annotations

import torch

from meshlm.core.errors import ConfigError
from meshlm.interop.hf.qwen_moe import (  # noqa: F401  (the family's interface)
    CLASS,
    build,
    canonical,
    check_export,
    common_from_hf,
    common_to_hf,
    config_class,
    fill_buffers,
    hf_tensors,
    is_extra,
    read_block,
    refuse,
    write_blocks,
)

MODEL_TYPE = "qwen3_moe"


def owns(cfg) -> bool:
    """A MoEConfig exports as Qwen3-MoE when its attention normalises queries and keys."""
    return bool(cfg.qk_norm)


def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm MoEConfig from a Hugging Face Qwen3-MoE ``config.json`` dict (``qk_norm``
    on); ``attention_bias`` true (which Qwen3 puts on the output projection too) is a
    ConfigError."""
    fields = common_from_hf(hf, MODEL_TYPE, source)
    if hf.get("attention_bias"):
        raise ConfigError(
            f"{source}: attention_bias=true; meshlm's Qwen3-MoE attention has no biases (Qwen3's would bias o_proj too)"
        )
    return config_class()(**fields, qk_norm=True)


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face Qwen3-MoE ``config.json`` dict for a meshlm MoEConfig with
    ``qk_norm``; what Qwen3-MoE cannot express is a ConfigError naming the field."""
    refuse(
        cfg,
        "Qwen3-MoE",
        [
            ("qk_norm", cfg.qk_norm, "Qwen3-MoE normalises each head's query and key"),
            ("qkv_bias", not cfg.qkv_bias, "Qwen3-MoE's attention_bias would bias o_proj too"),
            ("shared_mlp", cfg.shared_mlp == 0, "Qwen3-MoE has no shared expert"),
        ],
    )
    hf = common_to_hf(cfg, dtype)
    hf.update(architectures=["Qwen3MoeForCausalLM"], model_type=MODEL_TYPE, attention_bias=False)
    return hf
