"""Byte-level text data: a tokenizer, a train/val split and a data-parallel sharded loader.

Every rank builds the same :class:`ShardedLoader` (same tokens, same seed) and takes its
own rows of each global batch, so the ranks of one step together see exactly the batch a
single-device run sees, with no communication.

Validation: build a fresh ``ShardedLoader`` on ``TokenDataset.val`` for every evaluation
and take its first ``n`` batches.  A fresh loader starts at epoch 0, so every evaluation
scores the same windows and losses are comparable across steps.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from meshlm.errors import ConfigError


@dataclass
class DataConfig:
    """The ``data`` config section."""

    path: str | None = None  #: UTF-8 text file; None = the pydoc topics text in Python itself
    val_fraction: float = 0.05  #: trailing fraction of the tokens held out for validation
    seed: int = 0  #: seeds the per-epoch window order


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
        """Bytes back to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return bytes(ids).decode("utf-8", errors="replace")


def load_text(path: str | None) -> str:
    """The text of the UTF-8 file at ``path``; with None, the default corpus.

    The default corpus is the English help text that ships with CPython
    (``pydoc_data.topics``, several hundred KB), so training runs with no download.
    """
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics))
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.path={path!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
            "convert it to UTF-8 or set data.path=null for the default corpus"
        ) from e
    except OSError as e:
        raise ConfigError(
            f"data.path={path!r} cannot be read ({e.strerror or e}); point data.path at "
            "an existing UTF-8 text file or set data.path=null for the default corpus"
        ) from e


def _split_point(n: int, val_fraction: float) -> int:
    return n - int(n * val_fraction)


def _fits(n: int, val_fraction: float, window: int) -> bool:
    cut = _split_point(n, val_fraction)
    return cut >= window and n - cut >= window


@dataclass(frozen=True)
class TokenDataset:
    """A corpus as byte tokens: ``train`` is the leading ``1 - val_fraction``, ``val`` the rest."""

    train: Tensor
    val: Tensor

    @classmethod
    def from_config(cls, cfg: DataConfig, seq_len: int) -> TokenDataset:
        """Load, encode and split ``cfg``'s corpus.

        Each split must hold at least one window of ``seq_len + 1`` tokens.
        """
        if not 0.0 < cfg.val_fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction={cfg.val_fraction} must lie strictly between 0 and 1 "
                "(both splits need at least one window); e.g. set data.val_fraction=0.05"
            )
        tokens = ByteTokenizer().encode(load_text(cfg.path))
        window, n = seq_len + 1, len(tokens)
        if not _fits(n, cfg.val_fraction, window):
            vf = cfg.val_fraction
            # Start just below the real-valued bound; float rounding may put it off by one.
            needed = max(math.ceil(window / vf), math.ceil(window / (1 - vf))) - 2
            while not _fits(needed, vf, window):
                needed += 1
            where = "the default corpus" if cfg.path is None else repr(cfg.path)
            raise ConfigError(
                f"data.path={where} has {n} bytes, too short for one window of train.seq_len+1="
                f"{window} tokens in both splits (data.val_fraction={cfg.val_fraction}); it needs "
                f"at least {needed} bytes: use a longer file or reduce train.seq_len"
            )
        cut = _split_point(n, cfg.val_fraction)
        return cls(train=tokens[:cut], val=tokens[cut:])


class ShardedLoader:
    """Endless, deterministic, data-parallel batches of next-token windows.

    ``tokens`` is cut into non-overlapping windows of ``seq_len + 1``.  Epoch ``e`` visits
    the windows in a permutation seeded by ``(seed, e)``; global step ``i`` of the epoch
    takes windows ``perm[i*global_batch:(i+1)*global_batch]`` and this rank keeps rows
    ``[dp_rank*B, (dp_rank+1)*B)`` of them, ``B = global_batch // dp_size``.  Windows left
    over at the end of an epoch are dropped, so no window repeats within an epoch.
    """

    def __init__(
        self, tokens: Tensor, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
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

    def next(self) -> tuple[Tensor, Tensor]:
        """This rank's ``(inputs, labels)`` of the next global step.

        Both are LongTensors of shape ``(global_batch // dp_size, seq_len)``.
        """
        start = self.step_in_epoch * self.global_batch
        idx = self._permutation(self.epoch)[start : start + self.global_batch][self.rows]
        w = self.windows[idx]
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
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
