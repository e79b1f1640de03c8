"""Hugging Face Qwen2-MoE <-> meshlm MoETransformer (the ``qwen2_moe`` family of
meshlm/interop/hf/__init__.py): Llama's attention with biases on the query, key and value
projections (``qkv_bias``), top-k of ``num_experts`` experts plus a shared expert whose
output is scaled by ``sigmoid(shared_expert_gate . x)`` (``shared_mlp``, ``shared_gate``),
the gates renormalised only with ``norm_topk_prob`` (default false).  Names and shapes:
NOTE [HF Qwen-MoE tensors] in meshlm/interop/hf/qwen_moe.py."""

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

MODEL_TYPE = "qwen2_moe"


def owns(cfg) -> bool:
    """A MoEConfig exports as Qwen2-MoE when its attention has biases or its shared expert
    is gated (and its attention does not normalise queries and keys: Qwen3-MoE's)."""
    return not cfg.qk_norm and bool(cfg.qkv_bias or cfg.shared_gate)


def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm MoEConfig from a Hugging Face Qwen2-MoE ``config.json`` dict: ``qkv_bias``
    (default true), the gated shared expert of ``shared_expert_intermediate_size``."""
    fields = common_from_hf(hf, MODEL_TYPE, source)
    shared = hf.get("shared_expert_intermediate_size", 5632)
    if not shared or shared < 0:
        raise ConfigError(
            f"{source}: shared_expert_intermediate_size={shared}; meshlm reads a Qwen2-MoE with a shared expert "
            "(a positive width)"
        )
    return config_class()(**fields, qkv_bias=bool(hf.get("qkv_bias", True)), shared_mlp=shared, shared_gate=True)


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face Qwen2-MoE ``config.json`` dict for a meshlm MoEConfig; what Qwen2-MoE
    cannot express is a ConfigError naming the field."""
    refuse(
        cfg,
        "Qwen2-MoE",
        [
            ("qk_norm", not cfg.qk_norm, "Qwen2-MoE does not normalise queries and keys"),
            ("shared_mlp", cfg.shared_mlp > 0, "Qwen2-MoE has a shared expert"),
            ("shared_gate", cfg.shared_gate, "Qwen2-MoE gates its shared expert"),
        ],
    )
    hf = common_to_hf(cfg, dtype)
    hf.update(
        architectures=["Qwen2MoeForCausalLM"],
        model_type=MODEL_TYPE,
        qkv_bias=cfg.qkv_bias,
        shared_expert_intermediate_size=cfg.shared_mlp,
    )
    return hf
