"""DCP's ``.metadata`` read without running code (NOTE [trusted checkpoint files] in
meshlm/train/checkpoint/load.py).

``torch.distributed.checkpoint`` writes a checkpoint's metadata as a pickle and reads it
back with ``pickle.load``, which calls whatever the file names (``os.system`` included);
its default load planner reads non-tensor entries with ``torch.load(weights_only=False)``.
Here the metadata is unpickled by a ``find_class`` that admits only what a DCP metadata
holds: its dataclasses, ``torch.Size``, dtypes, the layout, a path.  Some of these are
named by private paths (``filesystem._StorageInfo``, ``metadata._MEM_FORMAT_ENCODING``,
the layout through ``torch.serialization._get_layout``), which is why this file is here.
The names are those a meshlm checkpoint's metadata holds under torch 2.13; DCP's metadata
classes are the same on 2.11 and 2.12.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_MD = "torch.distributed.checkpoint.metadata"
# (module, name) -> what it resolves to, for the classes a DCP metadata pickle names
_CLASSES = {
    (_MD, "Metadata"),
    (_MD, "MetadataIndex"),
    (_MD, "StorageMeta"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # StorageMeta.checkpoint_id: the directory the save wrote (3.13 names pathlib._local)
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PureWindowsPath"),
}


class UnsafeMetadata(pickle.UnpicklingError):
    """A metadata pickle that names something a DCP metadata never holds."""


def _layout(name: str) -> torch.layout:
    """``torch.strided`` for ``"torch.strided"``: what torch pickles a layout as (a name
    that ``torch.serialization._get_layout`` looks up), without calling torch's function."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise UnsafeMetadata(f"unknown tensor layout {name!r}")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise UnsafeMetadata(f"it names {module}.{name}, which a checkpoint's metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata("it holds a persistent reference, which a checkpoint's metadata never holds")


def read_metadata(f: str) -> Metadata:
    """The DCP ``Metadata`` in file ``f``, unpickled without calling anything but the
    constructors of what a metadata holds.  Raises ``UnsafeMetadata`` for a file that names
    anything else, ``OSError`` or another ``pickle.UnpicklingError``/``ValueError``/... for
    an unreadable or corrupted one."""
    with open(f, "rb") as fh:
        md = _Unpickler(io.BytesIO(fh.read())).load()
    if not isinstance(md, Metadata):
        raise UnsafeMetadata(f"it holds a {type(md).__name__}, not a checkpoint's metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` runs no code (``read_metadata``
    above); the tensor files it reads with ``torch.load(weights_only=True)`` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = read_metadata(os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, without its ``torch.load(weights_only=False)`` of
    non-tensor entries: a meshlm checkpoint's DCP part holds tensors only, so a
    non-tensor entry where a tensor is loaded is refused."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UnsafeMetadata(
            f"`{read_item.dest_index.fqn}` is stored as pickled bytes, not a tensor; meshlm never writes that"
        )
