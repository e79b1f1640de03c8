"""Hugging Face LLaVA (a CLIP vision tower, a projector, a Llama) <-> meshlm VLM: names,
shapes and configs (the ``llava`` family of meshlm/interop/hf/__init__.py; the reading and writing machinery is
meshlm/interop/hf/load.py and meshlm/interop/hf/save.py).

NOTE [HF LLaVA tensors]
    Tensors are known here by the names transformers 5 gives them in memory
    (``model.vision_tower.encoder.layers.0.self_attn.q_proj.weight``,
    ``model.multi_modal_projector.linear_1.weight``, ``model.language_model.layers.0...``,
    ``lm_head.weight``).  Files name them otherwise: ``save_pretrained`` of 5.x writes
    ``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*`` and
    ``language_model.lm_head.weight``; checkpoints from before 5.0 put the tower's tensors
    under ``vision_model.`` (``vision_tower.vision_model.*``, ``model.vision_tower.vision_model.*``).
    ``canonical`` maps each of those onto the in-memory name; ``save_hf`` writes those.
    The bytes are meshlm's in every case, only the header's shape differs: the patch
    convolution ``(embed, channels, patch, patch)`` is meshlm's linear ``(embed, channels *
    patch * patch)`` (row-major, patches flattened in the same (channel, row, column) order),
    and the per-head attention weights and biases are reshapes as in NOTE [HF names] in
    meshlm/interop/hf/llama.py.  The tower's layers after the feature layer and its
    ``post_layernorm`` never reach LLaVA's logits, so meshlm builds none of them and skips
    their tensors when reading (an exported directory lacks them; transformers fills them
    with its init, which changes no logit).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor, nn

from meshlm.core.errors import CheckpointError, ConfigError
from meshlm.interop.hf import llama as hf_llama

MODEL_TYPE = "llava"
CLASS = "VLM"  # the meshlm class a checkpoint's meta.json names

_TOWER = "model.vision_tower."
_LANG = "model.language_model."
# older and on-disk prefixes -> the in-memory ones (NOTE [HF LLaVA tensors]); first match wins
_PREFIXES = (
    ("model.vision_tower.vision_model.", _TOWER),
    ("vision_tower.vision_model.", _TOWER),
    ("vision_tower.", _TOWER),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("language_model.model.", _LANG),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_TOP = {
    "patch_embed": "embeddings.patch_embedding.weight",
    "class_emb": "embeddings.class_embedding",
    "pos_emb": "embeddings.position_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight",
    "pre_norm.bias": "pre_layrnorm.bias",
}
_VISION_LAYER = {
    "ln_1.weight": "layer_norm1.weight",
    "ln_1.bias": "layer_norm1.bias",
    "ln_2.weight": "layer_norm2.weight",
    "ln_2.bias": "layer_norm2.bias",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.bq": "self_attn.q_proj.bias",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.wo": "self_attn.out_proj.weight",
    "attn.bo": "self_attn.out_proj.bias",
    "mlp.fc1.weight": "mlp.fc1.weight",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.weight": "mlp.fc2.weight",
    "mlp.fc2.bias": "mlp.fc2.bias",
}
_QKV = ("attn.wq", "attn.wk", "attn.wv")
_QKV_BIAS = ("attn.bq", "attn.bk", "attn.bv")


def config_class():
    from meshlm.models.vlm import VLMConfig

    return VLMConfig


def build(cfg) -> nn.Module:
    from meshlm.models.vlm import VLM

    return VLM(cfg, device="meta")


def _to_llava(llama_name: str) -> str:
    return _LANG + llama_name[len("model.") :] if llama_name.startswith("model.") else llama_name


def _to_llama(name: str) -> str:
    return "model." + name[len(_LANG) :] if name.startswith(_LANG) else name


def hf_name(fqn: str) -> str:
    """The Hugging Face tensor name of a meshlm VLM parameter FQN (NOTE [HF LLaVA tensors])."""
    head, _, rest = fqn.partition(".")
    if head == "language":
        return _to_llava(hf_llama.hf_name(rest))
    if head == "projector" and rest.startswith(("linear_1.", "linear_2.")):
        return "model.multi_modal_projector." + rest
    if head == "vision":
        if rest in _VISION_TOP:
            return _TOWER + _VISION_TOP[rest]
        parts = rest.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[2] in _VISION_LAYER:
            return f"{_TOWER}encoder.layers.{parts[1]}.{_VISION_LAYER[parts[2]]}"
    raise CheckpointError(f"parameter `{fqn}` has no Hugging Face LLaVA name")


def hf_tensor(cfg, fqn: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(HF name, HF shape) of the meshlm parameter ``fqn`` of ``shape``."""
    if fqn.startswith("language."):
        name, hs = hf_llama.hf_tensor(cfg.language, fqn[len("language.") :], shape)
        return _to_llava(name), hs
    if fqn == "vision.patch_embed":
        hs: tuple[int, ...] = (shape[0], cfg.channels, cfg.patch_size, cfg.patch_size)
    elif fqn.endswith(_QKV):
        hs = (shape[0] * shape[1], shape[2])
    elif fqn.endswith(_QKV_BIAS):
        hs = (shape[0] * shape[1],)
    elif fqn.startswith("vision.") and fqn.endswith("attn.wo"):
        hs = (shape[0], shape[1] * shape[2])
    else:
        hs = tuple(shape)
    return hf_name(fqn), hs


def canonical(name: str) -> str:
    """The name a tensor of an HF LLaVA file is known by here (NOTE [HF LLaVA tensors])."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_extra(cfg, name: str) -> bool:
    """A tensor an HF LLaVA file may hold that is no meshlm parameter: the tower's layers
    after the feature layer and its post-norm (never used for LLaVA's logits), position-id
    buffers older files saved, and the Llama's extras (hf_llama.is_extra)."""
    if name.startswith(_LANG) or name == "lm_head.weight":
        return hf_llama.is_extra(cfg.language, _to_llama(name))
    if name.startswith(_TOWER):
        rest = name[len(_TOWER) :]
        if rest.startswith("post_layernorm.") or rest.endswith("position_ids"):
            return True
        m = re.fullmatch(r"encoder\.layers\.(\d+)\..+", rest)
        return m is not None and cfg.used_layers <= int(m.group(1)) < cfg.vision_layers
    return False


# --------------------------------------------------------------------------- configs
def _get(d: dict, key: str, where: str, default=None):
    if key in d and d[key] is not None:
        return d[key]
    if default is None:
        raise ConfigError(f"{where}.{key}: missing; meshlm needs it to build the model")
    return default


def config_from_hf(hf: dict, source: str = "config.json"):
    """meshlm VLMConfig from a Hugging Face LLaVA ``config.json`` dict; what meshlm's VLM
    does not compute is a ConfigError naming the key."""
    mt = hf.get("model_type")
    if mt != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type={mt!r}; this reads Hugging Face LLaVA configs only")
    text = dict(hf.get("text_config") or {})
    vision = dict(hf.get("vision_config") or {})
    tmt, vmt = text.get("model_type", "llama"), vision.get("model_type", "clip_vision_model")
    if tmt != "llama":
        raise ConfigError(f"{source}: text_config.model_type={tmt!r}; meshlm's VLM decodes with its Llama ('llama')")
    if vmt != "clip_vision_model":
        raise ConfigError(
            f"{source}: vision_config.model_type={vmt!r}; meshlm's VLM encodes images with a CLIP vision "
            "tower ('clip_vision_model')"
        )
    layer = hf.get("vision_feature_layer", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ConfigError(
            f"{source}: vision_feature_layer={layer!r}; meshlm's VLM takes the features of one layer (an int)"
        )
    for key, want, what in (
        ("vision_feature_select_strategy", "default", "drops the class token ('default')"),
        ("projector_hidden_act", "gelu", "projects with exact GELU ('gelu')"),
        ("multimodal_projector_bias", True, "has projector biases (true)"),
    ):
        if hf.get(key, want) != want:
            raise ConfigError(f"{source}: {key}={hf[key]!r}, but meshlm's VLM {what}")
    act = vision.get("hidden_act", "quick_gelu")
    if act != "quick_gelu":
        raise ConfigError(f"{source}: vision_config.hidden_act={act!r}; meshlm's vision MLP uses 'quick_gelu'")
    tie = bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    language = hf_llama.config_from_hf({**text, "model_type": "llama"}, f"{source}: text_config")
    image_token = hf.get("image_token_index", hf.get("image_token_id", 32000))
    if not 0 <= image_token < language.vocab:
        raise ConfigError(
            f"{source}: image_token_index={image_token} is outside text_config.vocab_size={language.vocab}; "
            "meshlm's VLM embeds the image token as a token of the decoder's vocabulary"
        )
    v = f"{source}: vision_config"
    try:
        return config_class()(
            language=replace(language, tie_embeddings=tie),
            image_size=_get(vision, "image_size", v),
            patch_size=_get(vision, "patch_size", v),
            channels=_get(vision, "num_channels", v, 3),
            vision_embed=_get(vision, "hidden_size", v),
            vision_layers=_get(vision, "num_hidden_layers", v),
            vision_heads=_get(vision, "num_attention_heads", v),
            vision_mlp=_get(vision, "intermediate_size", v),
            norm_eps=float(_get(vision, "layer_norm_eps", v, 1e-5)),
            feature_layer=layer,
            image_token=image_token,
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face LLaVA ``config.json`` dict for a meshlm VLMConfig."""
    text = {k: v for k, v in hf_llama.config_to_hf(cfg.language, dtype).items() if k != "architectures"}
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": cfg.vision_embed,
            "intermediate_size": cfg.vision_mlp,
            "num_hidden_layers": cfg.vision_layers,
            "num_attention_heads": cfg.vision_heads,
            "num_channels": cfg.channels,
            "image_size": cfg.image_size,
            "patch_size": cfg.patch_size,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": cfg.norm_eps,
            "initializer_range": cfg.init_std,
        },
        "image_token_index": cfg.image_token,
        "image_seq_length": cfg.patches,
        "projector_hidden_act": cfg.projector_act,
        "vision_feature_layer": cfg.feature_layer,
        "vision_feature_select_strategy": "default",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": cfg.language.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


# --------------------------------------------------------------------------- blocks
Read = Callable[[str, tuple[int, ...], list[tuple[int, int]]], Tensor]


def read_block(read: Read, cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]]) -> Tensor:
    """This rank's block (``box`` in meshlm's ``shape``) of parameter ``fqn``; ``read(name,
    hf_shape, hf_box)`` reads a block of an HF tensor."""
    if fqn.startswith("language."):
        return hf_llama.read_block(
            lambda n, s, b: read(_to_llava(n), s, b), cfg.language, fqn[len("language.") :], shape, box
        )
    name, hs = hf_tensor(cfg, fqn, shape)
    if fqn == "vision.patch_embed":
        (e0, en), (k0, kn) = box
        t = read(name, hs, [(e0, en), *((0, n) for n in hs[1:])])
        return t.reshape(en, -1)[:, k0 : k0 + kn]
    if fqn.endswith(_QKV_BIAS):
        (h0, hn), (d0, dn) = box
        hd = shape[1]
        return read(name, hs, [(h0 * hd, hn * hd)]).reshape(hn, hd)[:, d0 : d0 + dn]
    if fqn.endswith(_QKV):
        (h0, hn), (d0, dn), (e0, en) = box
        hd = shape[1]
        return read(name, hs, [(h0 * hd, hn * hd), (e0, en)]).reshape(hn, hd, en)[:, d0 : d0 + dn]
    if fqn.endswith("attn.wo"):
        (e0, en), (h0, hn), (d0, dn) = box
        hd = shape[2]
        return read(name, hs, [(e0, en), (h0 * hd, hn * hd)]).reshape(en, hn, hd)[:, :, d0 : d0 + dn]
    return read(name, hs, box)


def write_blocks(
    cfg, fqn: str, shape: tuple[int, ...], box: list[tuple[int, int]], local: Tensor
) -> list[tuple[tuple[int, ...], list[tuple[int, int]], Tensor]]:
    """(row-major shape, box, block) to write for this rank's block ``local`` of ``fqn``:
    the bytes are HF's in meshlm's shape (NOTE [HF LLaVA tensors])."""
    return [(tuple(shape), box, local)]
