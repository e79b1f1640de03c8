"""Prompts with an image, for a vision-language model (``meshlm generate --image``): each
prompt's token ids start with the model's image tokens, one per image feature (NOTE
[image merge] in meshlm/models/vlm.py), and its image goes to the prefill as ``images``,
read and resized as training reads them (meshlm/data/images.py: RGB in [0, 1])."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from meshlm.core.errors import ConfigError


def image_prompts(
    model: Any, paths: Sequence[str], ids: Sequence[Sequence[int]]
) -> tuple[list[list[int]], dict[str, Tensor]]:
    """(prompt ids with the image tokens in front, ``{"images": (batch, 3, S, S)}``): one
    image per prompt, in order."""
    from meshlm.data.images import read_image

    cfg = getattr(model, "cfg", None)
    token, patches, size = (getattr(cfg, k, None) for k in ("image_token", "patches", "image_size"))
    if token is None or patches is None or size is None:
        raise ConfigError(
            f"--image: model {type(model).__name__} reads no images (its config has no image_token, patches "
            "and image_size): give --image to a vision-language model (meshlm.models.VLM)"
        )
    if len(paths) != len(ids):
        raise ConfigError(f"--image given {len(paths)} time(s) for {len(ids)} prompt(s): give one image per prompt")
    arrays = [read_image(Path(p), size, f"--image {p}") for p in paths]
    images = torch.stack([torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 255.0 for a in arrays])
    return [[token] * patches + list(p) for p in ids], {"images": images}
