"""The ``data`` config section (its readers are in :mod:`meshlm.data`; this module imports
no torch, so :mod:`meshlm.config` stays light for the ``meshlm`` command's launcher)."""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("text", "tokens")


@dataclass
class DataConfig:
    """The ``data`` config section."""

    #: text: UTF-8 text (``path``: a file, a directory of ``.txt`` files, or a glob), tokenized by
    #: ``tokenizer``; tokens: a directory holding ``train.bin`` and ``val.bin``, flat uint16 token ids
    format: str = "text"
    path: str | None = None  #: see ``format``; None = the pydoc topics text in Python itself (text only)
    #: text only: ``auto`` (the tokenizer.json of ``model.init_from``'s directory if it has one, else bytes),
    #: ``bytes`` (UTF-8 bytes, 256 ids), or a Hugging Face tokenizer: a directory holding tokenizer.json, or the file
    tokenizer: str = "auto"
    val_fraction: float = 0.05  #: text only: trailing fraction of the tokens held out for validation
    seed: int = 0  #: seeds the per-epoch window order
