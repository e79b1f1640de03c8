"""A LLaVA-style vision-language model, written against logical axes: a CLIP-style vision
encoder (``vision``, meshlm/models/vision.py), a two-layer projector (``projector``) and
meshlm's Llama (``language``),
whose token embeddings take the projected image features at the image token's positions.

Submodule paths are the handles a layout scopes its rules by (NOTE [scoped layouts] in
meshlm/core/scopes.py), and each of the three is called as a module, so a scope on it runs its
forward under the scope's rules.  ``language`` is meshlm's Llama, reused, not copied: a
subclass whose forward may start from given input embeddings (Llama's ``embed_tokens`` and
``from_embeddings``, the two halves of ``Llama.forward``); the merge runs between them,
under the top level's rules.  The vision blocks use the standard axes ``embed``, ``heads``,
``head_dim`` and ``mlp`` with ``patch`` for positions; the vision ``embed`` is the encoder's
width, another size than the decoder's, under the same role.

NOTE [image merge]
    Row ``b`` of ``tokens`` holds either no ``image_token`` or exactly ``patches`` of them;
    the ``j``-th of them takes feature ``j`` of image ``b`` (rows without one pass a zero
    image).  The merge is data-independent: a one-hot ``(batch, seq, patches)`` from the
    running count of image tokens, a batched matmul with the ``(batch, patches, embed)``
    features, and ``where``.  Every op keeps ``batch`` (and ``embed``) sharded under DTensor,
    and no Python branch reads a tensor value, so the encoder runs on every call that has
    ``images`` and every rank issues the same collectives.  A text row's features meet a
    zero one-hot row: its logits do not depend on its image, and no gradient reaches the
    encoder from it.  Loading Hugging Face LLaVA weights: meshlm/interop/hf/llava.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core import nn as mnn
from meshlm.core.annotate import Axes, constrain, init_params
from meshlm.models.llama import Llama, LlamaConfig, llama_fields
from meshlm.models.vision import VisionEncoder

# Patches are whole inside attention and MLP (as positions are in meshlm/models/llama.py).
WHOLE = None
ACTS = ("gelu",)  # projector activations (Hugging Face's names)
# The pixel statistics CLIP's (and LLaVA's) image processor normalises with
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _error(msg: str) -> Exception:
    from meshlm.core.errors import ConfigError

    return ConfigError(msg)


@dataclass(frozen=True)
class VLMConfig:
    """Architecture hyperparameters only.  ``vision_layers`` is the encoder's depth as
    published; the features are its hidden state after ``feature_layer`` layers (negative:
    counted from the end, -1 = the last layer's output, -2 = Hugging Face LLaVA's default),
    so only ``used_layers`` layers are built and run."""

    language: LlamaConfig = field(default_factory=lambda: LlamaConfig(vocab=272))
    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    vision_embed: int = 32
    vision_layers: int = 3
    vision_heads: int = 4
    vision_mlp: int = 64
    norm_eps: float = 1e-5
    feature_layer: int = -2
    # Pixel normalisation inside the model, per channel: (images - mean) / std, for images in
    # [0, 1] as meshlm's data and ``meshlm generate --image`` give them; None: the images come
    # normalised (a Hugging Face LLaVA's pixel_values; its processor normalises them).
    pixel_mean: Optional[tuple[float, ...]] = None
    pixel_std: Optional[tuple[float, ...]] = None
    image_token: int = 256  # a token id of the decoder's vocabulary: where image features go
    projector_act: str = "gelu"
    init_std: float = 0.02

    def __post_init__(self):
        if isinstance(self.language, Mapping):  # from to_dict() or a YAML node
            object.__setattr__(self, "language", LlamaConfig(**self.language))
        for f in ("image_size", "patch_size", "channels", "vision_embed", "vision_layers", "vision_heads"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _error(f"model.{f}={v!r} must be a positive integer")
        if self.vision_mlp <= 0:
            raise _error(f"model.vision_mlp={self.vision_mlp!r} must be a positive integer")
        if self.image_size % self.patch_size:
            raise _error(f"model.image_size={self.image_size} is not divisible by model.patch_size={self.patch_size}")
        if self.vision_embed % self.vision_heads:
            raise _error(
                f"model.vision_embed={self.vision_embed} is not divisible by model.vision_heads={self.vision_heads}"
            )
        if not -(self.vision_layers + 1) <= self.feature_layer <= self.vision_layers:
            raise _error(
                f"model.feature_layer={self.feature_layer} is outside the {self.vision_layers + 1} hidden states of a "
                f"{self.vision_layers}-layer encoder (-{self.vision_layers + 1} .. {self.vision_layers})"
            )
        for f in ("pixel_mean", "pixel_std"):
            v = getattr(self, f)
            if v is not None:
                if not isinstance(v, (list, tuple)) or len(v) != self.channels:
                    raise _error(f"model.{f}={v!r}: give one number per channel ({self.channels}), or null")
                object.__setattr__(self, f, tuple(float(x) for x in v))
        if (self.pixel_mean is None) != (self.pixel_std is None) or any(x <= 0 for x in self.pixel_std or ()):
            raise _error(
                f"model.pixel_mean={self.pixel_mean} and model.pixel_std={self.pixel_std}: give both (std > 0) or neither"
            )
        if not 0 <= self.image_token < self.language.vocab:
            raise _error(
                f"model.image_token={self.image_token} is not a token id of the decoder's vocabulary "
                f"(model.language.vocab={self.language.vocab})"
            )
        if self.projector_act not in ACTS:
            raise _error(f"model.projector_act={self.projector_act!r}; meshlm's projector uses {', '.join(ACTS)}")

    @property
    def used_layers(self) -> int:
        """Encoder layers built and run: those before the feature layer."""
        f = self.feature_layer
        return f if f >= 0 else self.vision_layers + 1 + f

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patches(self) -> int:
        """Image features per image (the class token is dropped): image tokens per row."""
        return self.grid**2

    @property
    def pixels(self) -> int:
        """Values of one flattened patch, ordered (channel, row, column)."""
        return self.channels * self.patch_size**2

    @property
    def vocab(self) -> int:
        return self.language.vocab

    def num_params(self) -> int:
        e, m, n = self.vision_embed, self.vision_mlp, self.language.embed
        blk = 4 * e * e + 4 * e + 2 * e * m + m + e + 4 * e
        vision = e * self.pixels + e + (self.patches + 1) * e + 2 * e + self.used_layers * blk
        return vision + e * n + n + n * n + n + self.language.num_params()

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, VLMConfig] = {
    # tests: every sharded dim divides 4; byte tokens 0..255, the image token 256
    "vlm_tiny": VLMConfig(
        language=LlamaConfig(vocab=272, embed=64, layers=2, heads=8, kv_heads=4, mlp=128),
        image_size=16,
        patch_size=4,
        vision_embed=32,
        vision_layers=3,
        vision_heads=4,
        vision_mlp=64,
    ),
    # the CPU demo: 32x32 images of 16 patches
    "vlm_small": VLMConfig(
        language=LlamaConfig(vocab=272, embed=256, layers=4, heads=8, kv_heads=4, mlp=704),
        image_size=32,
        patch_size=8,
        vision_embed=128,
        vision_layers=4,
        vision_heads=4,
        vision_mlp=512,
        pixel_mean=CLIP_MEAN,
        pixel_std=CLIP_STD,
    ),
}


def vlm_fields(**fields) -> VLMConfig:
    """A VLMConfig from ``model.<field>`` values (``conf/model/vlm_*.yaml``); ``language``
    may be a mapping of :class:`LlamaConfig` fields.  An unknown field, or a value of
    another type than the field's, is a ConfigError naming the key."""
    from meshlm.core.arg_types import check_fields
    from meshlm.core.axes import closest

    known = [f.name for f in dataclass_fields(VLMConfig)]
    for k in fields:
        if k not in known:
            raise _error(
                f"model.{k}: meshlm.models.vlm_model takes no argument {k!r}{closest(k, known)}; it takes: "
                f"{', '.join(known)}"
            )
    check_fields(VLMConfig, fields, "meshlm.models.vlm_model")
    lang = fields.get("language")
    if isinstance(lang, Mapping):
        from meshlm.core.errors import ConfigError

        try:
            fields["language"] = llama_fields(**lang)
        except ConfigError as e:
            raise _error(f"model.language: {e}") from None
    return VLMConfig(**{k: v for k, v in fields.items() if v is not None})


def vlm_model(device=None, seed: Optional[int] = 0, **fields) -> "VLM":
    """The ``_target_`` of ``conf/model/vlm_*.yaml``: a :class:`VLM` of the given
    :class:`VLMConfig` fields, built on ``device``."""
    return VLM(vlm_fields(**fields), device=device, seed=seed)


def vlm_config(name: str, **overrides) -> VLMConfig:
    """A named config, optionally with fields overridden."""
    if name not in CONFIGS:
        raise _error(f"model: unknown VLM config {name!r}; choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class Projector(nn.Module):
    """Vision features -> the decoder's width: linear_1, GELU, linear_2 (column- then
    row-parallel under ``mlp: tp``)."""

    def __init__(self, cfg: VLMConfig, device=None):
        super().__init__()
        e, n, std = cfg.vision_embed, cfg.language.embed, cfg.init_std
        self.linear_1 = mnn.Linear(e, n, axes=("embed", "mlp"), init_std=std, device=device)
        self.linear_2 = mnn.Linear(n, n, axes=("mlp", "embed"), init_std=std, device=device)

    def forward(self, x: Tensor) -> Tensor:  # (batch, patch, vision embed) -> (batch, patch, embed)
        x = constrain(x, ("batch", WHOLE, "embed"))
        h = constrain(F.gelu(self.linear_1(x)), ("batch", WHOLE, "mlp"))
        return constrain(self.linear_2(h), ("batch", "patch", "embed"))


class Language(Llama):
    """meshlm's Llama whose forward may start from input embeddings: ``embeddings`` (batch,
    seq, embed), when given, stand for the embeddings of ``tokens``."""

    def forward(
        self, tokens: Tensor, labels: Optional[Tensor] = None, cache=None, embeddings: Optional[Tensor] = None
    ) -> Tensor:
        x = self.embed_tokens(tokens) if embeddings is None else embeddings
        return self.from_embeddings(x, labels, cache)


class VLM(nn.Module):
    """LLaVA-style vision-language model.  ``forward(tokens, images=images)`` gives logits
    ``(batch, seq, vocab)``; with ``labels`` (already shifted, -100 ignored, as for
    :class:`Llama`) the mean next-token cross-entropy."""

    input_axes: ClassVar[dict[str, Axes]] = {
        "tokens": ("batch", "seq"),
        "labels": ("batch", "seq"),
        "images": ("batch", "channels", None, None),
    }

    def __init__(self, cfg: VLMConfig, device=None, seed: Optional[int] = 0):
        """Built on ``device`` (``"meta"`` for a model that lowering materialises shard by
        shard).  On a real device the weights are initialised from ``seed`` (None: leave
        them uninitialised)."""
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg, device)
        self.projector = Projector(cfg, device)
        self.language = Language(cfg.language, device=device, seed=None)
        if seed is not None and torch.device(device or "cpu").type != "meta":
            init_params(self, seed)

    def forward(
        self, tokens: Tensor, labels: Optional[Tensor] = None, images: Optional[Tensor] = None, cache=None
    ) -> Tensor:
        """``tokens`` (batch, seq); ``images`` (batch, channels, height, width), one per row
        (zeros for a row without image tokens; NOTE [image merge]).  ``cache``: a KV cache
        when decoding (NOTE [KV cache] in meshlm/infer/cache.py): the prefill brings the
        images, later steps new tokens only."""
        if images is None:
            return self.language(tokens, labels, cache)
        x = self.merge(tokens, self.language.embed_tokens(tokens), self.projector(self.vision(images)))
        return self.language(tokens, labels, cache, embeddings=x)

    def example_inputs(self, batch: int, seq: int) -> dict[str, Tensor]:
        """The inputs besides tokens and labels of a step of ``batch`` rows, for ``meshlm
        plan``'s measured step (shapes only): one image per row."""
        c = self.cfg
        return {"images": torch.zeros(batch, c.channels, c.image_size, c.image_size)}

    def merge(self, tokens: Tensor, x: Tensor, feats: Tensor) -> Tensor:
        """Token embeddings ``x`` (batch, seq, embed) with the image features ``feats``
        (batch, patch, embed) at the image tokens of ``tokens`` (NOTE [image merge])."""
        tokens = constrain(tokens, ("batch", WHOLE))
        x = constrain(x, ("batch", WHOLE, "embed"))
        feats = constrain(feats, ("batch", WHOLE, "embed"))
        is_img = tokens == self.cfg.image_token
        slot = (is_img.long().cumsum(1) - 1).clamp(min=0)  # the feature each image token takes
        which = torch.arange(self.cfg.patches, device=slot.device)
        onehot = (slot[..., None] == which).to(feats.dtype)  # (batch, seq, patch)
        merged = torch.bmm(onehot, feats).to(x.dtype)
        return constrain(torch.where(is_img[..., None], merged, x), ("batch", "seq", "embed"))
