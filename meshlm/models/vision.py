"""The vision encoder of meshlm.models.VLM: CLIP's vision transformer, written against logical
axes (``embed``, ``heads``, ``head_dim``, ``mlp``, with ``patch`` for positions and ``pixel``
for the values of a flattened patch), configured by the ``vision_*`` fields of a
:class:`meshlm.models.vlm.VLMConfig` (NOTE [image merge] in meshlm/models/vlm.py).  The
patch embedding is a linear layer over flattened patches, not a convolution: the same
weights (a Hugging Face conv weight reshapes into it), and a matmul DTensor shards as any
other."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core import nn as mnn
from meshlm.core.annotate import Axes, block, constrain

# Patches are whole inside attention and MLP (as positions are in meshlm/models/llama.py).
WHOLE = None


def _error(msg: str) -> Exception:
    from meshlm.core.errors import ConfigError

    return ConfigError(msg)


def quick_gelu(x: Tensor) -> Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over patches, with biases; weights stored per
    head (as in meshlm/models/llama.py), so ``heads`` over ``tp`` is checked against the head
    count."""

    param_axes: ClassVar[dict[str, Axes]] = {
        "wq": ("heads", "head_dim", "embed"),
        "bq": ("heads", "head_dim"),
        "wk": ("heads", "head_dim", "embed"),
        "bk": ("heads", "head_dim"),
        "wv": ("heads", "head_dim", "embed"),
        "bv": ("heads", "head_dim"),
        "wo": ("embed", "heads", "head_dim"),
        "bo": ("embed",),
    }

    def __init__(self, cfg: Any, device=None):  # cfg: a meshlm.models.vlm.VLMConfig
        super().__init__()
        self.cfg = cfg
        h, e = cfg.vision_heads, cfg.vision_embed
        hd = e // h
        for n in ("q", "k", "v"):
            setattr(self, f"w{n}", nn.Parameter(torch.empty(h, hd, e, device=device)))
            setattr(self, f"b{n}", nn.Parameter(torch.empty(h, hd, device=device)))
        self.wo = nn.Parameter(torch.empty(e, h, hd, device=device))
        self.bo = nn.Parameter(torch.empty(e, device=device))

    def init_weights(self, gen: torch.Generator) -> None:
        std = self.cfg.init_std
        for w in (self.wq, self.wk, self.wv):
            nn.init.normal_(w, std=std, generator=gen)
        nn.init.normal_(self.wo, std=std / math.sqrt(2 * self.cfg.used_layers), generator=gen)
        for b in (self.bq, self.bk, self.bv, self.bo):
            nn.init.zeros_(b)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, patch, embed)
        h = self.cfg.vision_heads
        x = constrain(x, ("batch", WHOLE, "embed"))

        def project(w: Tensor, b: Tensor) -> Tensor:  # -> (batch, heads, patch, head_dim)
            y = F.linear(x, w.flatten(0, 1), b.flatten()).unflatten(-1, (h, w.shape[1])).transpose(1, 2)
            return constrain(y, ("batch", "heads", WHOLE, "head_dim"))

        q, k, v = project(self.wq, self.bq), project(self.wk, self.bk), project(self.wv, self.bv)
        o = constrain(F.scaled_dot_product_attention(q, k, v), ("batch", "heads", WHOLE, "head_dim"))
        o = o.transpose(1, 2).flatten(2, 3)  # (batch, patch, heads * head_dim)
        return constrain(F.linear(o, self.wo.flatten(1, 2), self.bo), ("batch", "patch", "embed"))


class VisionMLP(nn.Module):
    """embed -> mlp -> embed with quick GELU."""

    def __init__(self, cfg: Any, device=None):  # cfg: a meshlm.models.vlm.VLMConfig
        super().__init__()
        e, m, std = cfg.vision_embed, cfg.vision_mlp, cfg.init_std
        self.fc1 = mnn.Linear(e, m, axes=("embed", "mlp"), init_std=std, device=device)
        self.fc2 = mnn.Linear(m, e, axes=("mlp", "embed"), init_std=std / math.sqrt(2 * cfg.used_layers), device=device)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, patch, embed)
        x = constrain(x, ("batch", WHOLE, "embed"))
        h = constrain(quick_gelu(self.fc1(x)), ("batch", WHOLE, "mlp"))
        return constrain(self.fc2(h), ("batch", "patch", "embed"))


@block
class VisionBlock(nn.Module):
    """Pre-norm residual encoder block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: Any, device=None):  # cfg: a meshlm.models.vlm.VLMConfig
        super().__init__()
        self.ln_1 = mnn.LayerNorm(cfg.vision_embed, cfg.norm_eps, device=device)
        self.attn = VisionAttention(cfg, device)
        self.ln_2 = mnn.LayerNorm(cfg.vision_embed, cfg.norm_eps, device=device)
        self.mlp = VisionMLP(cfg, device)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, patch, embed)
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return constrain(x, ("batch", "patch", "embed"))


class VisionEncoder(nn.Module):
    """A CLIP-style ViT: patches (a linear map of each flattened patch, the form of a
    stride-``patch_size`` convolution), a class token, learned positions, a pre-norm and
    ``used_layers`` blocks.  ``forward(images)`` gives each patch's features (the class
    token dropped: Hugging Face LLaVA's "default" selection)."""

    logical_axes: ClassVar[dict[str, str]] = {"pixel": "values of one flattened image patch (channel, row, column)"}
    param_axes: ClassVar[dict[str, Axes]] = {
        "patch_embed": ("embed", "pixel"),
        "class_emb": ("embed",),
        "pos_emb": (None, "embed"),
    }

    def __init__(self, cfg: Any, device=None):  # cfg: a meshlm.models.vlm.VLMConfig
        super().__init__()
        self.cfg = cfg
        e = cfg.vision_embed
        self.patch_embed = nn.Parameter(torch.empty(e, cfg.pixels, device=device))
        self.class_emb = nn.Parameter(torch.empty(e, device=device))
        self.pos_emb = nn.Parameter(torch.empty(cfg.patches + 1, e, device=device))
        self.pre_norm = mnn.LayerNorm(e, cfg.norm_eps, device=device)
        self.layers = nn.ModuleList(VisionBlock(cfg, device) for _ in range(cfg.used_layers))

    def init_weights(self, gen: torch.Generator) -> None:
        for w in (self.patch_embed, self.class_emb, self.pos_emb):
            nn.init.normal_(w, std=self.cfg.init_std, generator=gen)

    def forward(self, images: Tensor) -> Tensor:  # (batch, channels, height, width) -> (batch, patch, embed)
        cfg = self.cfg
        b, g, p = images.shape[0], cfg.grid, cfg.patch_size
        want = (cfg.channels, cfg.image_size, cfg.image_size)
        if images.ndim != 4 or tuple(images.shape[1:]) != want:
            raise _error(f"VLM: images of shape {tuple(images.shape)}; the model reads (batch, *{want})")
        if cfg.pixel_mean is not None:
            mean = torch.tensor(cfg.pixel_mean, dtype=images.dtype, device=images.device)[:, None, None]
            std = torch.tensor(cfg.pixel_std, dtype=images.dtype, device=images.device)[:, None, None]
            images = (images - mean) / std
        # (b, c, gy, py, gx, px) -> (b, gy, gx, c, py, px): patches row-major, each flattened (c, py, px)
        x = images.reshape(b, cfg.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, cfg.pixels)
        w = self.patch_embed
        x = constrain(F.linear(constrain(x.to(w.dtype), ("batch", WHOLE, "pixel")), w), ("batch", WHOLE, "embed"))
        cls = torch.zeros_like(x[:, :1]) + self.class_emb  # keeps x's placements
        x = torch.cat([cls, x], 1) + self.pos_emb
        x = constrain(self.pre_norm(x), ("batch", "patch", "embed"))
        for layer in self.layers:
            x = layer(x)
        return x[:, 1:]
