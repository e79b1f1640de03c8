"""Image-text training data (``data.format=images``): image-caption pairs as rows of image
tokens, caption bytes and an end byte, with the images as a model input of their own.

The format: a directory holding ``captions.jsonl`` (``data.path`` may also name the file
itself), one JSON object a line::

    {"image": "images/cat.png", "text": "a cat on a mat"}    a file Pillow reads, relative to the directory
    {"image": 12, "text": "a red circle"}                    row 12 of images.npz (uint8, (N, H, W, 3))
    {"text": "a sentence without a picture"}                 "image" missing or null: a text-only sample

Images are converted to RGB and, at another size than ``image_size`` x ``image_size``, resized
to it with Pillow (bicubic; a non-square image is stretched).  ``data.path=null`` is the shapes
task (:mod:`meshlm.data.shapes`), written under the run directory on first use.

A sample is the window of ``seq_len + 1`` tokens ``[P image tokens] + caption bytes + "\\n"``
(the end byte; P = (image_size/patch_size)^2, no image tokens for a text-only sample), padded
with 0.  As for text, inputs are the first ``seq_len`` tokens and labels the next token at
each position, here -100 where that token is an image token or padding: the last image token
predicts the first caption byte.  Every rank reads the same samples and takes its rows of the
global batch exactly as :class:`meshlm.data.text.ShardedLoader` does (it is one).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from torch import Tensor

from meshlm.core.errors import ConfigError
from meshlm.data.config import BYTE_IDS, DataConfig, check_patches
from meshlm.data.pillow import pillow
from meshlm.data.text import ByteTokenizer, ShardedLoader, TokenDataset
from meshlm.models.node import ModelConfig, locate

if TYPE_CHECKING:
    from PIL import Image

END = "\n"  #: the end of every caption: byte tokenizers have no end-of-text id; meshlm generate --stop '\n'
IGNORE = -100  #: label of a position without loss (F.cross_entropy's ignore_index)
CAPTIONS = "captions.jsonl"
ARRAYS = "images.npz"
DEFAULT_IMAGE_TOKEN = BYTE_IDS  # the first id after the bytes


@dataclass(frozen=True)
class ImageSpec:
    """The image settings the data and the model share."""

    image_size: int
    patch_size: int
    image_token: int

    @property
    def patches(self) -> int:
        """P: image tokens per image."""
        return (self.image_size // self.patch_size) ** 2


def image_spec(cfg: DataConfig, model: ModelConfig, seq_len: int) -> ImageSpec:
    """``data.image_size``, ``data.patch_size`` and ``data.image_token``; each one that is null
    is the model's argument of that name (its config, else its signature's default).  A data
    key that disagrees with the model's argument is an error naming both."""
    declared = {}
    if model.target and not model.init_from:
        try:
            sig = inspect.signature(locate(model))
        except (TypeError, ValueError):  # a builtin without a signature: only its config
            sig = None
        if sig is not None:
            declared = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    out = {}
    for key in ("image_size", "patch_size", "image_token"):
        mine, theirs = getattr(cfg, key), model.args.get(key, declared.get(key))
        if mine is not None and theirs is not None and mine != theirs:
            raise ConfigError(
                f"data.{key}={mine} but model.{key}={theirs}: they must agree; set one of them (data.{key}=null "
                "takes the model's)"
            )
        value = mine if mine is not None else theirs
        if value is None and key == "image_token":
            value = DEFAULT_IMAGE_TOKEN
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(
                f"data.{key} is null and model {model.label} has no {key} argument: set data.{key}"
                if value is None
                else f"model.{key}={value!r} must be an integer"
            )
        out[key] = value
    spec = ImageSpec(**out)
    _check_spec(spec, seq_len)
    return spec


def _check_spec(spec: ImageSpec, seq_len: int) -> None:
    if spec.image_size < 1 or spec.patch_size < 1:
        raise ConfigError(f"data.image_size={spec.image_size} and data.patch_size={spec.patch_size} must be >= 1")
    if spec.image_token < BYTE_IDS:
        raise ConfigError(f"data.image_token={spec.image_token} is a byte id; choose an id >= {BYTE_IDS}")
    check_patches(spec.image_size, spec.patch_size, seq_len)


@dataclass(frozen=True)
class Sample:
    """One parsed line of captions.jsonl: ``image`` (RGB uint8 (S, S, 3), or None), its
    ``group`` (samples of one image stay in one split) and where it came from."""

    image: Optional[np.ndarray]
    text: str
    group: str
    where: str


def _to_array(img: Image.Image, size: int) -> np.ndarray:
    img = img.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), pillow().Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)


def read_samples(path: "str | os.PathLike", image_size: int) -> list[Sample]:
    """The samples of the captions file at ``path`` (a directory holding captions.jsonl, or
    the file), their images read and brought to ``image_size``."""
    p = Path(path)
    f = p / CAPTIONS if p.is_dir() else p
    if not f.is_file():
        hint = f"python -m meshlm.data.shapes {path}" if not p.exists() else "write captions.jsonl there"
        raise ConfigError(
            f"data.path={str(path)!r}: no {CAPTIONS} there (data.format=images reads a directory holding "
            f"{CAPTIONS}, or that file); {hint}, or set data.path=null for the generated shapes task"
        )
    root, arrays, cache = f.parent, None, {}
    out = []
    for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{f}:{no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path: {where}: not a JSON object ({e.msg}): {line[:80]!r}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str) or set(rec) - {"image", "text"}:
            raise ConfigError(
                f'data.path: {where}: each line is {{"image": PATH | INDEX | null, "text": CAPTION}} (keys image, '
                f"text; text a string), got {line[:80]!r}"
            )
        ref = rec.get("image")
        if ref is None:
            if not rec["text"]:
                raise ConfigError(f"data.path: {where}: a sample without an image needs a non-empty text")
            out.append(Sample(None, rec["text"], f"text:{no}", where))
            continue
        if isinstance(ref, bool) or not isinstance(ref, (str, int)):
            raise ConfigError(f"data.path: {where}: image={ref!r} must be a path, an index into {ARRAYS} or null")
        if ref not in cache:
            if isinstance(ref, int):
                if arrays is None:
                    arrays = _read_arrays(root / ARRAYS, where)
                if not 0 <= ref < len(arrays):
                    raise ConfigError(
                        f"data.path: {where}: image={ref} is not a row of {root / ARRAYS} (0..{len(arrays) - 1})"
                    )
                cache[ref] = _to_array(pillow().Image.fromarray(arrays[ref]), image_size)
            else:
                cache[ref] = read_image(root / ref, image_size, f"data.path: {where}")
        out.append(Sample(cache[ref], rec["text"], f"image:{ref!r}", where))
    if not out:
        raise ConfigError(f"data.path: {f} holds no samples")
    return out


def read_image(f: Path, image_size: int, where: str) -> np.ndarray:
    """The image file ``f`` as uint8 (image_size, image_size, 3), RGB, resized; ``where``
    (the config key or argument that named it) starts the error of a missing or bad file."""
    if not f.is_file():
        raise ConfigError(f"{where}: image file {f} does not exist")
    try:
        with pillow().Image.open(f) as img:
            return _to_array(img, image_size)
    except OSError as e:
        raise ConfigError(f"{where}: {f} is not an image Pillow can read ({e})") from None


def _read_arrays(f: Path, where: str) -> np.ndarray:
    if not f.is_file():
        raise ConfigError(f"data.path: {where}: an integer image indexes {f}, which does not exist")
    with np.load(f) as z:
        if "images" not in z:
            raise ConfigError(f"data.path: {f} holds no array 'images' (it holds {', '.join(z.files) or 'none'})")
        a = z["images"]
    if a.dtype != np.uint8 or a.ndim != 4 or a.shape[-1] != 3:
        raise ConfigError(f"data.path: {f}: 'images' is {a.dtype} {a.shape}; it must be uint8 (N, H, W, 3)")
    return a


@dataclass(frozen=True)
class ImageTextSplit:
    """One split as tensors: ``windows`` (N, seq_len + 1) token ids, ``labels`` (N, seq_len),
    ``images`` (M, 3, S, S) uint8 and ``image_of`` (N,) the row of ``images`` (-1: none)."""

    windows: Tensor
    labels: Tensor
    images: Tensor
    image_of: Tensor

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1] - 1

    def images_of(self, idx: Tensor) -> Tensor:
        """float32 (len(idx), 3, S, S) in [0, 1]; zeros for a text-only sample."""
        rows = self.image_of[idx]
        out = torch.zeros((len(idx), *self.images.shape[1:]), dtype=torch.float32)
        has = rows >= 0
        if bool(has.any()):
            out[has] = self.images[rows[has]].float() / 255
        return out


def tokenize(samples: list[Sample], spec: ImageSpec, seq_len: int) -> ImageTextSplit:
    """Samples -> windows, labels and images (a sample too long for ``seq_len`` is an error)."""
    tok, window, n = ByteTokenizer(), seq_len + 1, len(samples)
    windows = torch.zeros(n, window, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    image_of = torch.full((n,), -1, dtype=torch.long)
    images, row_of = [], {}  # samples of one image (several captions) share its row
    for i, s in enumerate(samples):
        n_img = spec.patches if s.image is not None else 0
        text = tok.encode(s.text + END)
        if n_img + len(text) > window:
            raise ConfigError(
                f"data.path: {s.where}: {n_img} image tokens and {len(text)} caption bytes (with the end byte) "
                f"do not fit a window of train.seq_len+1={window} tokens; raise train.seq_len to at least "
                f"{n_img + len(text) - 1} or shorten the caption"
            )
        windows[i, :n_img] = spec.image_token
        windows[i, n_img : n_img + len(text)] = text
        start = max(n_img - 1, 0)  # the label at position j is token j+1: from the last image token on
        labels[i, start : n_img + len(text) - 1] = windows[i, start + 1 : n_img + len(text)]
        if s.image is not None:
            if s.group not in row_of:
                row_of[s.group] = len(images)
                images.append(torch.from_numpy(np.ascontiguousarray(s.image.transpose(2, 0, 1))))
            image_of[i] = row_of[s.group]
    size = spec.image_size
    stacked = torch.stack(images) if images else torch.zeros(0, 3, size, size, dtype=torch.uint8)
    return ImageTextSplit(windows, labels, stacked, image_of)


def split_samples(samples: list[Sample], val_fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, val): the groups (one per image; one per text-only sample) in an order seeded by
    ``seed``, the first ``max(1, int(groups * val_fraction))`` of them val."""
    groups = list(dict.fromkeys(s.group for s in samples))
    if len(groups) < 2:
        raise ConfigError("data.path holds samples of a single image: a train and a val split need two")
    digest = hashlib.sha256(f"{seed}:split".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    order = torch.randperm(len(groups), generator=g).tolist()
    n_val = min(max(1, int(len(groups) * val_fraction)), len(groups) - 1)
    val = {groups[i] for i in order[:n_val]}
    return [s for s in samples if s.group not in val], [s for s in samples if s.group in val]


class ImageTextLoader(ShardedLoader):
    """:class:`meshlm.data.text.ShardedLoader`'s order and rows over the samples of a split;
    ``next()`` gives ``(tokens, labels, {"images": images})``."""

    def __init__(self, split: ImageTextSplit, global_batch: int, dp_rank: int, dp_size: int, seed: int, name: str):
        if len(split) < global_batch:
            raise ConfigError(
                f"the {name} split holds {len(split)} samples, fewer than a micro-batch of "
                f"train.batch_size/train.grad_accum={global_batch}; use more samples"
                + (", a larger data.val_fraction" if name == "val" else "")
                + " or reduce train.batch_size"
            )
        super().__init__(split.windows.reshape(-1), split.seq_len, global_batch, dp_rank, dp_size, seed)
        self.split = split

    def next(self) -> tuple[Tensor, Tensor, dict[str, Tensor]]:  # type: ignore[override]
        """This rank's rows of the next global step: tokens and labels, LongTensors
        ``(global_batch // dp_size, seq_len)``, and ``{"images": float32 (same, 3, S, S)}``."""
        idx = self.take()
        s = self.split
        return s.windows[idx, :-1].contiguous(), s.labels[idx], {"images": s.images_of(idx)}


@dataclass(frozen=True)
class ImageTextDataset:
    """The train and val splits of an image-caption data set, the :class:`ImageSpec` they were
    made for, the ids they use (``vocab_size``) and where they came from (``source``)."""

    train: ImageTextSplit
    val: ImageTextSplit
    spec: ImageSpec
    vocab_size: int
    source: str

    @classmethod
    def from_samples(
        cls, samples: list[Sample], spec: ImageSpec, seq_len: int, val_fraction: float, seed: int, source: str
    ) -> ImageTextDataset:
        train, val = split_samples(samples, val_fraction, seed)
        vocab = max(BYTE_IDS, spec.image_token + 1)
        return cls(tokenize(train, spec, seq_len), tokenize(val, spec, seq_len), spec, vocab, source)

    @classmethod
    def from_config(
        cls, cfg: DataConfig, seq_len: int, spec: ImageSpec, run_dir: "str | os.PathLike | None" = None
    ) -> ImageTextDataset:
        """``cfg.path``'s samples, or with ``cfg.path`` null the shapes task, written under
        ``run_dir/data`` first (or read from there when an earlier run wrote it)."""
        path = cfg.path
        if path is None:
            from meshlm.data.shapes import write_shapes

            if run_dir is None:
                raise ConfigError(
                    "data.path=null with data.format=images needs a run directory to write the shapes task"
                )
            name = f"shapes-n{cfg.shapes_samples}-s{spec.image_size}-t{cfg.shapes_text_only}-seed{cfg.seed}"
            path = str(
                write_shapes(
                    Path(run_dir) / "data" / name, cfg.shapes_samples, spec.image_size, cfg.seed, cfg.shapes_text_only
                )
            )
        samples = read_samples(path, spec.image_size)
        source = f"{'the shapes task in ' if cfg.path is None else ''}{path} ({len(samples)} samples)"
        return cls.from_samples(samples, spec, seq_len, cfg.val_fraction, cfg.seed, source)

    def loader(
        self, split: str, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ) -> ImageTextLoader:
        """An :class:`ImageTextLoader` over ``split`` ("train" or "val")."""
        s: ImageTextSplit = getattr(self, split)
        if s.seq_len != seq_len:
            raise ValueError(f"the data set was made for seq_len={s.seq_len}, not {seq_len}")
        return ImageTextLoader(s, global_batch, dp_rank, dp_size, seed, split)

    def check_vocab(self, model_vocab: int | None, model: str) -> None:
        """The image token must index the model's vocabulary (None: the model names none)."""
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(
                f"data: data.image_token={self.spec.image_token} needs a vocabulary of {self.vocab_size} ids but "
                f"model {model} has {model_vocab}; set model.vocab={self.vocab_size} (or more) or a smaller "
                f"data.image_token (>= {BYTE_IDS})"
            )


def open_dataset(cfg: DataConfig, seq_len: int, model: ModelConfig, run_dir: "str | os.PathLike | None" = None) -> Any:
    """The training data ``cfg`` names: a :class:`meshlm.data.text.TokenDataset` (text, tokens) or
    an :class:`ImageTextDataset` (images); both have ``loader(split, ...)`` and ``check_vocab``."""
    if cfg.format != "images":
        return TokenDataset.from_config(cfg, seq_len, init_from=model.init_from)
    return ImageTextDataset.from_config(cfg, seq_len, image_spec(cfg, model, seq_len), run_dir)
