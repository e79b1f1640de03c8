"""Training data: text (a file, a directory or a glob of ``.txt`` files) tokenized as UTF-8
bytes or by a Hugging Face tokenizer (``tokenizer.json``), or pre-tokenized token files read
by memory map (nanoGPT's flat uint16 ``train.bin`` / ``val.bin``); a train/val split and a
data-parallel sharded loader.

Every rank builds the same :class:`ShardedLoader` (same tokens, same seed) and takes its
own rows of each global batch, so the ranks of one step together see exactly the batch a
single-device run sees, with no communication.

Validation: build a fresh ``ShardedLoader`` on ``TokenDataset.val`` for every evaluation
and take its first ``n`` batches.  A fresh loader starts at epoch 0, so every evaluation
scores the same windows and losses are comparable across steps.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from meshlm.core.errors import ConfigError
from meshlm.data.config import FORMATS, DataConfig  # noqa: F401 (DataConfig: meshlm.data.text's API)


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, every string round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        """``text`` as a 1-D LongTensor of its UTF-8 bytes."""
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Bytes back to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD, and
        so does an id that is no byte (a model with a larger vocabulary may generate one)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        parts, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                parts += [run.decode("utf-8", errors="replace"), "\ufffd"]
                run = bytearray()
        return "".join(parts) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``): what a model directory
    from the Hub ships.  ``encode`` adds no special tokens."""

    def __init__(self, path: str, key: str = "data.tokenizer"):
        f = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not f.is_file():
            raise ConfigError(
                f"{key}={path!r}: no tokenizer.json there; give a directory holding tokenizer.json (a "
                "Hugging Face model or tokenizer directory), the file itself, or data.tokenizer=bytes"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(f"{key}={path!r} needs the tokenizers package: pip install tokenizers") from None
        self.path = str(f)
        self.tok = Tokenizer.from_file(self.path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> Tensor:
        return torch.tensor(self.tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        return self.tok.decode(ids.tolist() if isinstance(ids, Tensor) else list(ids))


def tokenizer_for(cfg: DataConfig, init_from: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``cfg.tokenizer``, with ``auto`` meaning the tokenizer of the Hugging Face model
    ``init_from`` when its directory has a tokenizer.json, else bytes."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.tokenizer == "auto":
        d = Path(init_from.removeprefix("hf:")) if init_from else None
        if d is not None and (d / "tokenizer.json").is_file():
            return HFTokenizer(str(d), key="model.init_from")
        return ByteTokenizer()
    return HFTokenizer(cfg.tokenizer)


def text_files(path: str) -> list[Path]:
    """The files ``data.path`` names: itself, the ``.txt`` files under a directory, or a
    glob's matches (``**`` recursive); sorted, so every rank reads them in the same order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not files and (p / "train.bin").exists():
            raise ConfigError(f"data.path={path!r} holds train.bin: pre-tokenized files need data.format=tokens")
        what = "holds no .txt files"
    elif any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        what = "matches no files"
    else:
        return [p]
    if not files:
        raise ConfigError(
            f"data.path={path!r} {what}; point data.path at a UTF-8 text file, a directory of .txt "
            "files or a glob (data/*.txt), or set data.path=null for the default corpus"
        )
    return files


def load_text(path: str | None) -> str:
    """The text at ``path`` (:func:`text_files`; several files are joined by a blank line);
    with None, the default corpus.

    The default corpus is the English help text that ships with CPython
    (``pydoc_data.topics``, several hundred KB), so training runs with no download.
    """
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics))
    return "\n\n".join(_read(str(f), path) for f in text_files(path))


def _read(f: str, path: str) -> str:
    try:
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.path={path!r}: {f} is not UTF-8 text ({e.reason} at byte {e.start}); "
            "convert it to UTF-8 or set data.path=null for the default corpus"
        ) from e
    except OSError as e:
        raise ConfigError(
            f"data.path={path!r} cannot be read ({e.strerror or e}); point data.path at "
            "an existing UTF-8 text file or set data.path=null for the default corpus"
        ) from e


def read_tokens(path: str, split: str) -> np.ndarray:
    """``<path>/<split>.bin`` as a read-only memory map of uint16 token ids (nanoGPT's format:
    ``np.array(ids, dtype=np.uint16).tofile(path)``)."""
    f = Path(path) / f"{split}.bin"
    if not f.is_file():
        raise ConfigError(
            f"data.path={path!r} has no {split}.bin; data.format=tokens reads train.bin and val.bin, "
            "flat uint16 token ids, from the directory data.path"
        )
    if f.stat().st_size % 2 or f.stat().st_size == 0:
        raise ConfigError(
            f"data.path={path!r}: {f.name} holds {f.stat().st_size} bytes, not a whole, non-empty "
            "array of uint16 token ids"
        )
    return np.memmap(f, dtype=np.uint16, mode="r")


def _split_point(n: int, val_fraction: float) -> int:
    return n - int(n * val_fraction)


def _fits(n: int, val_fraction: float, window: int) -> bool:
    cut = _split_point(n, val_fraction)
    return cut >= window and n - cut >= window


@dataclass(frozen=True)
class TokenDataset:
    """A corpus as token ids: ``train`` and ``val`` (LongTensors, or uint16 memory maps for
    ``data.format=tokens``); ``vocab_size`` bounds the ids (a tokenizer's vocabulary, or the
    largest id in the token files + 1); ``source`` says where they came from."""

    train: Tensor | np.ndarray
    val: Tensor | np.ndarray
    vocab_size: int = ByteTokenizer.vocab_size
    source: str = "the default corpus"

    @classmethod
    def from_config(cls, cfg: DataConfig, seq_len: int, init_from: str | None = None) -> TokenDataset:
        """Load, encode and split ``cfg``'s corpus (``init_from``: the Hugging Face model
        being fine-tuned, whose tokenizer ``data.tokenizer=auto`` picks).

        Each split must hold at least one window of ``seq_len + 1`` tokens.
        """
        if cfg.format not in FORMATS:
            raise ConfigError(f"data.format={cfg.format!r} is not allowed; choose one of: {', '.join(FORMATS)}")
        if cfg.format == "tokens":
            if cfg.path is None:
                raise ConfigError(
                    "data.format=tokens reads train.bin and val.bin from the directory data.path, "
                    "which is not set: set data.path=DIR"
                )
            train, val = read_tokens(cfg.path, "train"), read_tokens(cfg.path, "val")
            for name, t in (("train", train), ("val", val)):
                if len(t) < seq_len + 1:
                    raise ConfigError(
                        f"data.path={cfg.path!r}: {name}.bin holds {len(t)} tokens, fewer than one "
                        f"window of train.seq_len+1={seq_len + 1}; reduce train.seq_len"
                    )
            return cls(train, val, max(int(train.max()), int(val.max())) + 1, f"the token files in {cfg.path}")
        if not 0.0 < cfg.val_fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction={cfg.val_fraction} must lie strictly between 0 and 1 "
                "(both splits need at least one window); e.g. set data.val_fraction=0.05"
            )
        tok = tokenizer_for(cfg, init_from)
        tokens = tok.encode(load_text(cfg.path))
        unit = "bytes" if isinstance(tok, ByteTokenizer) else "tokens"
        window, n = seq_len + 1, len(tokens)
        if not _fits(n, cfg.val_fraction, window):
            vf = cfg.val_fraction
            # Start just below the real-valued bound; float rounding may put it off by one.
            needed = max(math.ceil(window / vf), math.ceil(window / (1 - vf))) - 2
            while not _fits(needed, vf, window):
                needed += 1
            where = "the default corpus" if cfg.path is None else repr(cfg.path)
            raise ConfigError(
                f"data.path={where} has {n} {unit}, too short for one window of train.seq_len+1="
                f"{window} tokens in both splits (data.val_fraction={cfg.val_fraction}); it needs "
                f"at least {needed} {unit}: use a longer file or reduce train.seq_len"
            )
        cut = _split_point(n, cfg.val_fraction)
        what = "UTF-8 bytes" if isinstance(tok, ByteTokenizer) else f"the tokenizer {tok.path}"
        where = "the default corpus" if cfg.path is None else cfg.path
        return cls(tokens[:cut], tokens[cut:], tok.vocab_size, f"{where} as {what}")

    def loader(
        self, split: str, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ) -> ShardedLoader:
        """A :class:`ShardedLoader` over the ``split`` ("train" or "val") tokens."""
        return ShardedLoader(getattr(self, split), seq_len, global_batch, dp_rank, dp_size, seed)

    def check_vocab(self, model_vocab: int | None, model: str) -> None:
        """Token ids must index the model's vocabulary (``model_vocab``: the size of its
        ``vocab`` axis; None: the model names none, nothing to check)."""
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(
                f"data: {self.source} has token ids up to {self.vocab_size - 1} ({self.vocab_size} ids) but model "
                f"{model} has a vocabulary of {model_vocab}; set model.vocab={self.vocab_size} (or more) or use "
                "data whose tokenizer fits the model (data.tokenizer)"
            )


class ShardedLoader:
    """Endless, deterministic, data-parallel batches of next-token windows.

    ``tokens`` is cut into non-overlapping windows of ``seq_len + 1``.  Epoch ``e`` visits
    the windows in a permutation seeded by ``(seed, e)``; global step ``i`` of the epoch
    takes windows ``perm[i*global_batch:(i+1)*global_batch]`` and this rank keeps rows
    ``[dp_rank*B, (dp_rank+1)*B)`` of them, ``B = global_batch // dp_size``.  Windows left
    over at the end of an epoch are dropped, so no window repeats within an epoch.
    """

    def __init__(
        self, tokens: Tensor | np.ndarray, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        if global_batch < 1 or global_batch % dp_size:
            raise ConfigError(
                f"train.batch_size={global_batch} is not a positive multiple of the data-parallel "
                f"size dp_size={dp_size}; set train.batch_size to a multiple of {dp_size}"
            )
        window = seq_len + 1
        n_windows = len(tokens) // window
        if n_windows < global_batch:
            raise ConfigError(
                f"{len(tokens)} tokens hold only {n_windows} windows of train.seq_len+1={window}, "
                f"fewer than train.batch_size={global_batch}; use a longer corpus (data.path) "
                "or reduce train.seq_len or train.batch_size"
            )
        self.windows = tokens[: n_windows * window].reshape(n_windows, window)
        self.global_batch = global_batch
        lo, hi = dp_rank * global_batch // dp_size, (dp_rank + 1) * global_batch // dp_size
        self.rows = slice(lo, hi)
        self.seed = seed
        self.steps_per_epoch = n_windows // global_batch
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm: tuple[int, Tensor] | None = None

    def _permutation(self, epoch: int) -> Tensor:
        if self._perm is None or self._perm[0] != epoch:
            # Hash (seed, epoch) rather than add them: seed+epoch would make run seed=1 epoch 0
            # replay run seed=0 epoch 1.  sha256, unlike hash(), is stable across processes.
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            self._perm = (epoch, torch.randperm(len(self.windows), generator=g))
        return self._perm[1]

    def take(self) -> Tensor:
        """The indices of the windows of this rank's rows of the next global step; moves the
        position on (a loader of other rows, meshlm.data.images, reads its own by them)."""
        start = self.step_in_epoch * self.global_batch
        idx = self._permutation(self.epoch)[start : start + self.global_batch][self.rows]
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return idx

    def next(self) -> tuple[Tensor, Tensor]:
        """This rank's ``(inputs, labels)`` of the next global step.

        Both are LongTensors of shape ``(global_batch // dp_size, seq_len)``.
        """
        idx = self.take()
        if isinstance(self.windows, np.ndarray):  # a memory map: read only these rows
            w = torch.from_numpy(self.windows[idx.numpy()].astype(np.int64))
        else:
            w = self.windows[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Batches forever, continuing from the current position."""
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch; with the same tokens and settings it fixes the rest."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ConfigError(
                f"loader state epoch={epoch} step_in_epoch={step} does not fit "
                f"{self.steps_per_epoch} steps per epoch: data.path, train.seq_len or "
                "train.batch_size differ from the run that saved it; restore them to resume"
            )
        self.epoch, self.step_in_epoch = epoch, step
