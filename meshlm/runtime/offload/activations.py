"""Activations saved for backward, kept in host memory or on disk until backward reads them.

NOTE [offloaded activations]
    ``offload.activations=host|disk`` runs each micro-batch's forward and backward under
    torch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the mechanism
    of ``torch.autograd.graph.save_on_cpu``): every tensor autograd saves for backward is
    handed to the tier when the forward saves it and fetched back when backward unpacks it.

    - ``host``: a copy in pinned host memory on an accelerator (as ``save_on_cpu``); on a
      CPU-only machine the device is host memory and nothing moves.
    - ``disk``: its bytes written to a file of the run's swap directory (NOTE [swapped
      storage] in store.py), read back when backward unpacks it, the file deleted when
      autograd frees what it saved (the graph, after backward); so
      between forward and backward the saved activations take no memory.

    Not moved: tensors smaller than ``min_bytes`` (64 KiB; a file per bias-sized tensor
    costs more than it saves), parameters and views of them (a matmul saves ``weight.t()``:
    in memory anyway) and views with gaps (a slice of a larger tensor: its base stays in memory
    anyway).  A moved tensor comes back with its own strides (a transpose stays one: a
    compiled block's backward reads saved tensors with the strides it traced).  A DTensor moves its local tensor and is rebuilt with the same placements.
    Backward reads exactly the bytes forward saved, so gradients are unchanged bit for bit
    (tests/dist/test_offload_activations.py).  It composes with activation checkpointing
    (only what a checkpointed block saves, its inputs, is moved) and compile per block
    (the tensors a compiled block's backward needs are saved through the same hooks).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm.runtime.memory import local_data
from meshlm.runtime.offload.store import SwapDir, _bytes

MIN_BYTES = 64 * 2**10


class _File:
    """A saved activation's file, deleted when autograd drops what it saved (after backward
    has used it: backward may unpack one saved tensor more than once)."""

    __slots__ = ("path", "__weakref__")

    def __init__(self, path: str):
        self.path = path

    def __del__(self):
        try:
            os.unlink(self.path)
        except OSError:
            pass


def stays(t: Tensor, local: Tensor, min_bytes: int = MIN_BYTES) -> bool:
    """Whether saved tensor ``t`` (``local``: its local tensor) stays where it is (NOTE
    [offloaded activations]): small, a parameter or a view of one, meta, or with gaps."""
    nbytes = local.numel() * local.element_size()
    return nbytes < min_bytes or _is_param(t) or local.device.type == "meta" or not _dense(local)


def _is_param(t: Tensor) -> bool:
    """A parameter or a view of one (a matmul saves ``weight.t()``): in memory anyway."""
    base = t if t._base is None else t._base
    return base.requires_grad and base.grad_fn is None


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory of exactly its size, in some order of
    its dims (contiguous, or a permutation of it, such as a transpose): its bytes can be
    written and read back with its own strides."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for st, n in dims:
        if st != expect:
            return False
        expect *= n
    return True


class ActivationOffload:
    """The pack and unpack hooks of one tier (NOTE [offloaded activations])."""

    def __init__(self, tier: str, disk: Optional[SwapDir] = None, min_bytes: int = MIN_BYTES):
        self.tier, self.disk, self.min_bytes = tier, disk, min_bytes
        self._ids = itertools.count()
        self.moved_bytes = 0  # bytes handed to the tier (each also fetched back once)
        self.kept = 0  # saved tensors left where they were (small, or parameters)
        # id(tensor) -> (weakref to it, its version, weakref to its payload, layout): a tensor
        # saved again while its first copy is alive shares that copy
        self._seen: dict[int, tuple] = {}
        if disk is not None:
            self.dir = disk.path / "activations"
            self.dir.mkdir(exist_ok=True)

    @contextlib.contextmanager
    def context(self):
        """The hooks as a context manager; a no-op where the tier moves nothing."""
        if self.tier == "device" or (self.tier == "host" and not torch.cuda.is_available()):
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._seen.clear()

    def pack(self, t: Tensor):
        local = local_data(t)
        nbytes = local.numel() * local.element_size()
        if nbytes < self.min_bytes or _is_param(t) or local.device.type == "meta" or not _dense(local):
            self.kept += 1
            return ("kept", t)
        spec = (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if isinstance(t, DTensor) else None
        seen = self._seen.get(id(local))  # one tensor saved by several ops (q, k and v read one input)
        if seen is not None and seen[0]() is local and seen[1] == local._version:
            payload = seen[2]()
            if payload is not None:
                return (self.tier, payload, seen[3], spec, t.requires_grad)
        self.moved_bytes += nbytes
        # the copy keeps the saved tensor's strides: a compiled backward reads them as saved
        layout = (tuple(local.shape), local.stride(), local.dtype, local.device)
        with torch.no_grad():
            if self.tier == "host":
                payload = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, pin_memory=True)
                payload.copy_(local, non_blocking=True)
                self._seen[id(local)] = (weakref.ref(local), local._version, weakref.ref(payload), layout)
                return ("host", payload, layout, spec, t.requires_grad)
            path = str(self.dir / f"a{next(self._ids)}.bin")
            data = local.detach()
            if data.device.type != "cpu" or data.storage_offset() or data.untyped_storage().nbytes() != nbytes:
                data = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype).copy_(local)
            with open(path, "wb") as f:
                f.write(_bytes(data))
            file = _File(path)
            self._seen[id(local)] = (weakref.ref(local), local._version, weakref.ref(file), layout)
            return ("disk", file, layout, spec, t.requires_grad)

    def unpack(self, packed) -> Tensor:
        kind = packed[0]
        if kind == "kept":
            return packed[1]
        _k, payload, (shape, stride, dtype, device), spec, rg = packed
        if kind == "host":
            local = payload.to(device, non_blocking=True)
        else:
            local = torch.empty_strided(shape, stride, dtype=dtype)
            with open(payload.path, "rb") as f:
                f.readinto(_bytes(local))
            local = local if device.type == "cpu" else local.to(device, non_blocking=True)
        return rebuild(local, spec, rg)


def rebuild(local: Tensor, spec, requires_grad: bool) -> Tensor:
    """A saved tensor back from its local tensor: as is (``spec`` None), or the DTensor of
    ``spec`` (mesh, placements, global shape and stride) around it."""
    if spec is None:
        return local
    mesh, placements, shape, stride = spec
    with torch.no_grad():
        out = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return out.requires_grad_(requires_grad) if requires_grad and out.is_leaf else out
