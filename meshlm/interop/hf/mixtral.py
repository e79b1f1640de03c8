"""Hugging Face Mixtral <-> meshlm MoETransformer: names, shapes and configs (the
``mixtral`` family of meshlm/interop/hf/__init__.py; the reading and writing machinery is
meshlm/interop/hf/load.py and meshlm/interop/hf/save.py).

NOTE [HF Mixtral tensors]
    Attention, norms, embedding and head are Llama's (NOTE [HF names] in
    meshlm/interop/hf/llama.py).  The mixture of experts is stored per expert in a
    Mixtral directory (``model.layers.{i}.block_sparse_moe.``):

    - ``router (experts, embed)``: ``gate.weight``;
    - ``w_gate[e] (mlp, embed)``: ``experts.{e}.w1.weight``;
    - ``w_up[e] (mlp, embed)``: ``experts.{e}.w3.weight``;
    - ``w_down[e] (embed, mlp)``: ``experts.{e}.w2.weight``,

    so one meshlm expert tensor is ``experts`` Hugging Face tensors: a rank whose block
    holds experts ``e0 .. e0+n`` reads (and writes) its rows and columns of those ``n``
    files' tensors only (``hf_tensors``, ``read_block``, ``write_blocks``).  The routing is
    the same computation (NOTE [moe routing] in meshlm/core/moe.py): softmax over the
    experts in float32, top-k of the probabilities, the k gates renormalised to sum to one
    (``norm_topk``), every token served (dropless, ``capacity_factor`` None).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError, ConfigError
from meshlm.interop.hf import llama as hf_llama

MODEL_TYPE = "mixtral"
CLASS = "MoETransformer"  # the meshlm class a checkpoint's meta.json names

_MOE = "block_sparse_moe"
_EXPERT = {"moe.w_gate": "w1", "moe.w_up": "w3", "moe.w_down": "w2"}


def config_class():
    from meshlm.models.moe import MoEConfig

    return MoEConfig


def build(cfg) -> nn.Module:
    from meshlm.models.moe import MoETransformer

    return MoETransformer(cfg, device="meta")


def _layer(fqn: str) -> tuple[str, str]:
    """(layer index, the rest) of ``layers.{i}.rest``."""
    _layers, i, rest = fqn.split(".", 2)
    return i, rest


def hf_tensors(cfg, fqn: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of each Hugging Face tensor the meshlm parameter ``fqn`` of
    ``shape`` is made of: one, or one per expert (NOTE [HF Mixtral tensors])."""
    if fqn.startswith("layers."):
        i, rest = _layer(fqn)
        if rest in _EXPERT:
            pre = f"model.layers.{i}.{_MOE}.experts"
            return [(f"{pre}.{e}.{_EXPERT[rest]}.weight", tuple(shape[1:])) for e in range(shape[0])]
        if rest == "moe.router":
            return [(f"model.layers.{i}.{_MOE}.gate.weight", tuple(shape))]
        if rest.startswith("moe."):
            raise CheckpointError(f"parameter `{fqn}` has no Hugging Face Mixtral name (Mixtral has no shared expert)")
    return [hf_llama.hf_tensor(cfg, fqn, shape)]


def hf_tensor(cfg, fqn: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(HF name, HF shape) of the meshlm parameter ``fqn`` when it is one Hugging Face
    tensor; an expert tensor is several (:func:`hf_tensors`)."""
    tensors = hf_tensors(cfg, fqn, shape)
    if len(tensors) != 1:
        raise CheckpointError(
            f"parameter `{fqn}` is {len(tensors)} Hugging Face Mixtral tensors, one per expert "
            f"({tensors[0][0]}, ...), not one"
        )
    return tensors[0]


def canonical(name: str) -> str:
    """The name a tensor of an HF file is known by here (Mixtral: its own)."""
    return name


def is_extra(cfg, name: str) -> bool:
    """A tensor an HF Mixtral file may hold that is no meshlm parameter (Llama's)."""
    return hf_llama.is_extra(cfg, name)


def fill_buffers(module: nn.Module) -> None:
    """The buffers no Mixtral file holds, as Mixtral routes: each MoE's ``selection_bias``
    zero (selection by the probabilities alone)."""
    from meshlm.core.moe import MoE

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, MoE):
                m.selection_bias.zero_()


def check_export(model: nn.Module) -> None:
    """A model Mixtral cannot express: a non-zero ``selection_bias`` (routing that Mixtral's
    top-k of the probabilities would not reproduce) is a ConfigError naming it."""
    for name, b in model.named_buffers():
        if name.endswith("selection_bias") and bool((b != 0).any()):
            raise ConfigError(
                f"buffer `{name}` is not zero: Hugging Face Mixtral picks experts by the router's "
                "probabilities alone, so this model's routing cannot be exported as Mixtral"
            )


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm MoEConfig from a Hugging Face Mixtral ``config.json`` dict.  Mixtral's router
    is MoEConfig's defaults (top-k of the softmax, renormalised, dropless); its
    load-balancing loss is taken as meshlm's ``balance_loss`` when the config trains with it
    (``output_router_logits``), computed per sequence as meshlm does (docs/moe.md)."""
    mt = hf.get("model_type", "mixtral")
    if mt != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type={mt!r}; this reads Hugging Face Mixtral configs only")
    if hf.get("sliding_window") is not None:
        raise ConfigError(
            f"{source}: sliding_window={hf['sliding_window']}; meshlm's MoETransformer attends to the whole "
            "causal context (set it to null if the model was trained that way)"
        )
    if hf.get("router_jitter_noise", 0.0):
        raise ConfigError(
            f"{source}: router_jitter_noise={hf['router_jitter_noise']}; meshlm's router has no jitter (set it to 0.0)"
        )
    llama = hf_llama.config_from_hf({**hf, "model_type": "llama", "intermediate_size": hf["intermediate_size"]}, source)
    return config_class()(
        **moe_fields(llama, hf, experts=hf["num_local_experts"], expert_mlp=hf["intermediate_size"]), norm_topk=True
    )


def moe_fields(llama, hf: dict, experts: int, expert_mlp: int) -> dict:
    """The MoEConfig fields an HF MoE config (Mixtral's, Qwen's) gives as a Llama's plus
    its routing: dropless, the load-balancing loss only where the config trains with it."""
    balance = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return dict(
        vocab=llama.vocab,
        embed=llama.embed,
        layers=llama.layers,
        heads=llama.heads,
        kv_heads=llama.kv_heads,
        head_dim=llama.head_dim,
        rope_theta=llama.rope_theta,
        norm_eps=llama.norm_eps,
        tie_embeddings=llama.tie_embeddings,
        init_std=float(hf.get("initializer_range", 0.02)),
        experts=experts,
        top_k=hf["num_experts_per_tok"],
        expert_mlp=expert_mlp,
        capacity_factor=None,
        balance_loss=balance,
        z_loss=0.0,
    )


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face Mixtral ``config.json`` dict for a meshlm MoEConfig; a config Mixtral
    cannot express (a shared expert, capacity routing, gates not renormalised, router
    z-loss) is a ConfigError naming the field."""
    for field, ok, why in (
        ("shared_mlp", cfg.shared_mlp == 0, "Mixtral has no shared expert"),
        ("capacity_factor", cfg.capacity_factor is None, "Mixtral is dropless"),
        ("norm_topk", cfg.norm_topk, "Mixtral renormalises the top-k gates"),
        ("z_loss", not cfg.z_loss, "Mixtral has no router z-loss"),
        ("qkv_bias", not cfg.qkv_bias, "Mixtral's attention has no biases"),
        ("qk_norm", not cfg.qk_norm, "Mixtral does not normalise queries and keys"),
    ):
        if not ok:
            raise ConfigError(f"model.{field}={getattr(cfg, field)}: cannot export as Hugging Face Mixtral ({why})")
    hf = hf_llama.attention_to_hf(cfg.attention(), dtype)
    hf.update(
        architectures=["MixtralForCausalLM"],
        model_type=MODEL_TYPE,
        intermediate_size=cfg.expert_mlp,
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.balance_loss,
        output_router_logits=bool(cfg.balance_loss),
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    for k in ("attention_bias", "mlp_bias"):
        hf.pop(k)
    return hf


# --------------------------------------------------------------------------- blocks
Read = Callable[[str, tuple[int, ...], list[tuple[int, int]]], Tensor]


def read_block(read: Read, cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (``box`` in meshlm's ``shape``) of parameter ``fqn``; ``read(name,
    hf_shape, hf_box)`` reads a block of an HF tensor: of each of its experts' tensors for
    an expert weight."""
    tensors = hf_tensors(cfg, fqn, shape)
    if not fqn.endswith(tuple(_EXPERT)):
        return (
            read(*tensors[0], box) if fqn.endswith(".moe.router") else hf_llama.read_block(read, cfg, fqn, shape, box)
        )
    (e0, en), *rest = box
    return torch.stack([read(*tensors[e], rest) for e in range(e0, e0 + en)])


def write_blocks(
    cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[str, tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """(HF name, row-major HF shape, box, block) to write for this rank's block ``local``
    (at ``box``) of ``fqn``: one per expert of the block for an expert weight."""
    return blocks_to_write(hf_tensors(cfg, fqn, shape), fqn.endswith(tuple(_EXPERT)), shape, box, local)


def blocks_to_write(
    tensors: list, expert: bool, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[str, tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """``write_blocks`` given the HF tensors of a parameter (``hf_tensors``): the block as it
    is, or for an expert weight (``expert``) one block per expert in ``box``'s first range."""
    if not expert:
        return [(tensors[0][0], tuple(shape), box, local)]
    (e0, en), *rest = box
    return [(*tensors[e0 + j], rest, local[j]) for j in range(en)]
