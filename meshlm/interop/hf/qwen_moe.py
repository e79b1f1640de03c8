"""Hugging Face Qwen2-MoE and Qwen3-MoE <-> meshlm MoETransformer: the names, shapes and
config keys the two share (the ``qwen2_moe`` and ``qwen3_moe`` families,
meshlm/interop/hf/qwen2_moe.py and meshlm/interop/hf/qwen3_moe.py, build on this module).

NOTE [HF Qwen-MoE tensors]
    Embedding, norms, head and attention are Llama's names (NOTE [HF names] in
    meshlm/interop/hf/llama.py), with Qwen's attention options: Qwen2-MoE's biases
    ``attn.bq``, ``attn.bk``, ``attn.bv`` (``self_attn.{q,k,v}_proj.bias``) and Qwen3-MoE's
    per-head norms ``attn.q_norm.weight``, ``attn.k_norm.weight``
    (``self_attn.{q,k}_norm.weight``, over ``head_dim``, applied before RoPE).  The mixture
    of experts is stored per expert (``model.layers.{i}.mlp.``):

    - ``router (experts, embed)``: ``gate.weight``;
    - ``w_gate[e]``, ``w_up[e] (mlp, embed)``: ``experts.{e}.gate_proj.weight``,
      ``experts.{e}.up_proj.weight``; ``w_down[e] (embed, mlp)``: ``experts.{e}.down_proj.weight``;
    - Qwen2-MoE's shared expert: ``shared_gate_proj``, ``shared_up``, ``shared_down``:
      ``shared_expert.{gate,up,down}_proj.weight``, and its gate ``shared_gate (1, embed)``:
      ``shared_expert_gate.weight``,

    so, as for Mixtral, a rank whose block holds experts ``e0 .. e0+n`` reads and writes its
    part of those ``n`` tensors only.  The routing is meshlm's (NOTE [moe routing] in
    meshlm/core/moe.py): softmax over the experts in float32, top-k of the probabilities,
    the gates renormalised only with ``norm_topk_prob`` (``norm_topk``; Qwen2-MoE's default
    false, Qwen3-MoE's checkpoints true), every token served (dropless).  Every layer is
    sparse: a config with dense layers (``decoder_sparse_step`` other than 1, a non-empty
    ``mlp_only_layers``) is refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError, ConfigError
from meshlm.interop.hf import llama as hf_llama
from meshlm.interop.hf.mixtral import blocks_to_write, build, config_class, fill_buffers, moe_fields  # noqa: F401  (the same model)

CLASS = "MoETransformer"  # the meshlm class a checkpoint's meta.json names

_EXPERT = {"moe.w_gate": "gate_proj", "moe.w_up": "up_proj", "moe.w_down": "down_proj"}
_ONE = {
    "moe.router": "gate.weight",
    "moe.shared_gate_proj": "shared_expert.gate_proj.weight",
    "moe.shared_up": "shared_expert.up_proj.weight",
    "moe.shared_down": "shared_expert.down_proj.weight",
    "moe.shared_gate": "shared_expert_gate.weight",
}


def hf_tensors(cfg, fqn: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of each Hugging Face tensor the meshlm parameter ``fqn`` of
    ``shape`` is made of: one, or one per expert (NOTE [HF Qwen-MoE tensors])."""
    if fqn.startswith("layers."):
        _layers, i, rest = fqn.split(".", 2)
        if rest in _EXPERT:
            pre = f"model.layers.{i}.mlp.experts"
            return [(f"{pre}.{e}.{_EXPERT[rest]}.weight", tuple(shape[1:])) for e in range(shape[0])]
        if rest in _ONE:
            return [(f"model.layers.{i}.mlp.{_ONE[rest]}", tuple(shape))]
        if rest.startswith("moe."):
            raise CheckpointError(f"parameter `{fqn}` has no Hugging Face Qwen-MoE name")
    return [hf_llama.hf_tensor(cfg, fqn, shape)]


def canonical(name: str) -> str:
    """The name a tensor of an HF file is known by here (Qwen-MoE: its own)."""
    return name


def is_extra(cfg, name: str) -> bool:
    """A tensor an HF Qwen-MoE file may hold that is no meshlm parameter (Llama's)."""
    return hf_llama.is_extra(cfg, name)


Read = Callable[[str, tuple[int, ...], list[tuple[int, int]]], Tensor]


def read_block(read: Read, cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (``box`` in meshlm's ``shape``) of parameter ``fqn``: of each of
    its experts' tensors for an expert weight."""
    tensors = hf_tensors(cfg, fqn, shape)
    if fqn.endswith(tuple(_EXPERT)):
        (e0, en), *rest = box
        return torch.stack([read(*tensors[e], rest) for e in range(e0, e0 + en)])
    if fqn.endswith(tuple(_ONE)):
        return read(*tensors[0], box)
    return hf_llama.read_block(read, cfg, fqn, shape, box)


def write_blocks(
    cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[str, tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """(HF name, row-major HF shape, box, block) to write for this rank's block ``local``
    (at ``box``) of ``fqn``: one per expert of the block for an expert weight."""
    return blocks_to_write(hf_tensors(cfg, fqn, shape), fqn.endswith(tuple(_EXPERT)), shape, box, local)


def check_export(model: nn.Module) -> None:
    """A non-zero ``selection_bias`` (routing Qwen-MoE's top-k of the probabilities would
    not reproduce) is a ConfigError naming it."""
    for name, b in model.named_buffers():
        if name.endswith("selection_bias") and bool((b != 0).any()):
            raise ConfigError(
                f"buffer `{name}` is not zero: Hugging Face Qwen-MoE picks experts by the router's "
                "probabilities alone, so this model's routing cannot be exported as Qwen-MoE"
            )


# --------------------------------------------------------------------------- configs
def common_from_hf(hf: dict, model_type: str, source: str) -> dict:
    """The MoEConfig fields both Qwen MoE configs fix; what meshlm cannot run (dense
    layers, sliding-window attention, no experts) is a ConfigError naming the key."""
    mt = hf.get("model_type", model_type)
    if mt != model_type:
        raise ConfigError(f"{source}: model_type={mt!r}; this reads Hugging Face {model_type} configs only")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(
            f"{source}: decoder_sparse_step={hf['decoder_sparse_step']}; meshlm's MoETransformer has experts in "
            "every layer (decoder_sparse_step 1), not dense layers between sparse ones"
        )
    if hf.get("mlp_only_layers"):
        raise ConfigError(
            f"{source}: mlp_only_layers={hf['mlp_only_layers']}; meshlm's MoETransformer has experts in every "
            "layer, no dense-MLP layers (mlp_only_layers must be empty)"
        )
    if hf.get("use_sliding_window"):
        raise ConfigError(
            f"{source}: use_sliding_window=true; meshlm's MoETransformer attends to the whole causal context "
            "(set it to false if the model was trained that way)"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ConfigError(f"{source}: num_experts={experts}; a {model_type} model without experts is not a MoE")
    plain = {**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False}
    llama = hf_llama.config_from_hf({**plain, "intermediate_size": hf["moe_intermediate_size"]}, source)
    fields = moe_fields(llama, hf, experts=experts, expert_mlp=hf["moe_intermediate_size"])
    return {**fields, "norm_topk": bool(hf.get("norm_topk_prob", False))}


def refuse(cfg, name: str, checks: list[tuple[str, bool, str]]) -> None:
    """A ConfigError naming the first MoEConfig field of ``checks`` (field, ok, why) that
    the Hugging Face architecture ``name`` cannot express."""
    for field, ok, why in checks:
        if not ok:
            raise ConfigError(f"model.{field}={getattr(cfg, field)}: cannot export as Hugging Face {name} ({why})")


def common_to_hf(cfg, dtype: torch.dtype) -> dict:
    """The ``config.json`` keys both Qwen MoE configs share, for a meshlm MoEConfig."""
    refuse(
        cfg,
        "Qwen-MoE",
        [
            ("capacity_factor", cfg.capacity_factor is None, "Qwen-MoE is dropless"),
            ("z_loss", not cfg.z_loss, "Qwen-MoE has no router z-loss"),
        ],
    )
    hf = hf_llama.attention_to_hf(replace(cfg.attention(), qkv_bias=False, qk_norm=False), dtype)
    for k in ("attention_bias", "mlp_bias"):
        hf.pop(k)
    hf.update(
        intermediate_size=cfg.expert_mlp,  # the width of a dense layer: there is none (every layer is sparse)
        moe_intermediate_size=cfg.expert_mlp,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=cfg.balance_loss,
        output_router_logits=bool(cfg.balance_loss),
        use_sliding_window=False,
        sliding_window=None,
    )
    return hf
