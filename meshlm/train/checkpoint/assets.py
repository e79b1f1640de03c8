"""The files a run carries besides its tensors: its tokenizer and the Hugging Face config it
started from.

NOTE [run tokenizer]
    A run records the tokenizer it trained with, so that what it saved decodes as it was
    encoded.  Rank 0 copies into the run directory, and every checkpoint holds a copy of
    (CRC-checked like its other files, NOTE [commit protocol] in checkpoint/__init__.py):

    - ``tokenizer.json`` (and ``tokenizer_config.json``, ``special_tokens_map.json`` where
      the tokenizer's directory has them): ``data.tokenizer``'s, or, with
      ``data.tokenizer=auto``, that of the checkpoint resumed or of ``model.init_from``;
    - ``generation_config.json`` and ``hf_config.json`` (the ``config.json`` of the Hugging
      Face model the run started from, under another name so that a checkpoint is never
      taken for a Hugging Face directory): its special-token ids, its
      ``max_position_embeddings`` and whatever else it says beyond the architecture.

    A run on UTF-8 bytes records no tokenizer, which is how ``meshlm generate`` knows to
    decode bytes.  ``meshlm generate`` and ``meshlm serve`` take a checkpoint's tokenizer
    and end-of-sequence ids by default (``--tokenizer auto``), and ``meshlm convert`` to
    Hugging Face writes the tokenizer, ``generation_config.json`` and a ``config.json``
    that keeps ``hf_config.json``'s keys (NOTE [faithful config] in meshlm/interop/hf/save.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GENERATION_CONFIG = "generation_config.json"
HF_CONFIG = "hf_config.json"  #: the source's config.json, renamed (NOTE [run tokenizer])
ASSETS = (*TOKENIZER_FILES, GENERATION_CONFIG, HF_CONFIG)


def tokenizer_assets(tokenizer_json: "str | os.PathLike") -> dict[str, str]:
    """``tokenizer.json`` and the tokenizer files beside it: name -> path."""
    f = Path(tokenizer_json)
    out = {"tokenizer.json": str(f)}
    for name in TOKENIZER_FILES[1:]:
        if (f.parent / name).is_file():
            out[name] = str(f.parent / name)
    return out


def hf_assets(hf_dir: "str | os.PathLike", tokenizer: bool = True) -> dict[str, str]:
    """A Hugging Face model directory's assets: its config.json (as ``hf_config.json``), its
    ``generation_config.json`` and (``tokenizer``) its tokenizer files."""
    d = Path(hf_dir)
    out = {}
    if (d / "config.json").is_file():
        out[HF_CONFIG] = str(d / "config.json")
    if (d / GENERATION_CONFIG).is_file():
        out[GENERATION_CONFIG] = str(d / GENERATION_CONFIG)
    if tokenizer and (d / "tokenizer.json").is_file():
        out.update(tokenizer_assets(d / "tokenizer.json"))
    return out


def dir_assets(d: "str | os.PathLike") -> dict[str, str]:
    """The assets a checkpoint (or run) directory holds: name -> path."""
    return {n: str(Path(d) / n) for n in ASSETS if (Path(d) / n).is_file()}


def asset_dir(source: "str | os.PathLike") -> Optional[Path]:
    """Where a model source keeps its assets: a Hugging Face directory itself; a checkpoint
    (a ``step_*`` directory, or a checkpoint.dir: its latest) its step directory; None when
    it is neither."""
    p = Path(str(source).removeprefix("hf:"))
    if (p / "config.json").is_file():
        return p
    from meshlm.core.errors import CheckpointError
    from meshlm.train.checkpoint.files import resolve_path

    try:
        return Path(resolve_path(str(p)))
    except (CheckpointError, OSError):
        return None


def source_config(source: "str | os.PathLike") -> dict:
    """The Hugging Face config of a model source: its ``config.json``, or a checkpoint's
    ``hf_config.json``; {} where there is none."""
    d = asset_dir(source)
    if d is None:
        return {}
    for name in ("config.json", HF_CONFIG):
        if (d / name).is_file():
            return json.loads((d / name).read_text())
    return {}
