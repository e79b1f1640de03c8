"""The ``data`` config section (its readers are in :mod:`meshlm.data.text` and
:mod:`meshlm.data.images`; this module imports no torch, so :mod:`meshlm.app.config` stays light
for the ``meshlm`` command's launcher)."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.core.errors import ConfigError

FORMATS = ("text", "tokens", "images")
BYTE_IDS = 256  #: captions of data.format=images are UTF-8 bytes: ids 0..255


@dataclass
class DataConfig:
    """The ``data`` config section."""

    #: text: UTF-8 text (``path``: a file, a directory of ``.txt`` files, or a glob), tokenized by
    #: ``tokenizer``; tokens: a directory holding ``train.bin`` and ``val.bin``, flat uint16 token ids;
    #: images: image-caption pairs (``path``: a directory holding captions.jsonl, or that file), docs/multimodal.md
    format: str = "text"
    #: see ``format``; None = the pydoc topics text in Python itself (text), the generated shapes task (images)
    path: str | None = None
    #: text only: ``auto`` (the tokenizer.json of ``model.init_from``'s directory if it has one, else bytes),
    #: ``bytes`` (UTF-8 bytes, 256 ids), or a Hugging Face tokenizer: a directory holding tokenizer.json, or the file
    tokenizer: str = "auto"
    #: text: trailing fraction of the tokens held out for validation; images: fraction of the images (and
    #: text-only samples), drawn by ``seed``
    val_fraction: float = 0.05
    seed: int = 0  #: seeds the per-epoch window order (images: also the train/val split and the shapes task)
    image_size: int | None = None  #: images: side of the square images (null: the model's image_size)
    patch_size: int | None = (
        None  #: images: side of a patch; (image_size/patch_size)^2 image tokens (null: the model's)
    )
    image_token: int | None = None  #: images: id of the image tokens (null: the model's image_token, else 256)
    shapes_samples: int = 2000  #: images with path null: samples in the generated shapes task
    shapes_text_only: float = 0.1  #: images with path null: fraction of the generated samples without an image


def check_images(cfg: DataConfig, seq_len: int) -> None:
    """The ``data.*`` keys of ``data.format=images`` that can be checked without the model
    (what is null comes from the model's arguments; meshlm.data.images checks it then)."""
    if cfg.tokenizer not in ("auto", "bytes"):
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer!r}: data.format=images tokenizes captions as UTF-8 bytes; "
            "set data.tokenizer=bytes (or auto)"
        )
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} must lie strictly between 0 and 1 (the fraction of the "
            "samples held out for validation); e.g. set data.val_fraction=0.1"
        )
    for key in ("image_size", "patch_size"):
        v = getattr(cfg, key)
        if v is not None and v < 1:
            raise ConfigError(f"data.{key}={v} must be >= 1 (or null: the model's {key})")
    if cfg.image_token is not None and cfg.image_token < BYTE_IDS:
        raise ConfigError(
            f"data.image_token={cfg.image_token} is a byte id (0..{BYTE_IDS - 1}), which captions use; "
            f"choose an id >= {BYTE_IDS} (the default is {BYTE_IDS})"
        )
    if cfg.shapes_samples < 2:
        raise ConfigError(f"data.shapes_samples={cfg.shapes_samples} must be >= 2 (a train and a val sample)")
    if not 0.0 <= cfg.shapes_text_only < 1.0:
        raise ConfigError(f"data.shapes_text_only={cfg.shapes_text_only} must lie in [0, 1)")
    if cfg.image_size is not None and cfg.patch_size is not None:
        check_patches(cfg.image_size, cfg.patch_size, seq_len)


def check_patches(image_size: int, patch_size: int, seq_len: int) -> int:
    """The number of image tokens P = (image_size/patch_size)^2; ConfigError when the patches
    do not tile the image or P image tokens leave no room in ``train.seq_len`` for a caption."""
    if image_size % patch_size:
        raise ConfigError(
            f"data.image_size={image_size} is not a multiple of data.patch_size={patch_size}: the patches "
            "must tile the image"
        )
    p = (image_size // patch_size) ** 2
    if seq_len < p + 1:
        raise ConfigError(
            f"train.seq_len={seq_len} leaves no room for a caption after the {p} image tokens of "
            f"data.image_size={image_size}, data.patch_size={patch_size}: set train.seq_len >= {p + 1} "
            "(and room for the captions)"
        )
    return p
