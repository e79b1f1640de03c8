"""Measuring tensor memory on any device, CPU included: live storages and their peak, and
a model's state by kind.

Used by ``meshlm train`` (memory by kind in every run's metrics and summary), the memory
tests (``tests/dist/test_memory_floor.py``) and the benchmarks (``benchmarks/bench_layouts.py``,
``benchmarks/memory_floor.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

from meshlm import _torch_compat as compat


def local_data(t):
    """The plain tensor that holds ``t``'s data on this rank: a DTensor's local tensor, and
    inside an AsyncCollectiveTensor (a collective in flight, a wrapper whose own storage
    holds no data) the tensor it wraps."""
    from torch.distributed.tensor import DTensor

    t = compat.local_tensor(t) if isinstance(t, DTensor) else t
    return getattr(t, "elem", t)


def where(t) -> tuple[int, int]:
    """Where ``t``'s data starts: its storage (the object, not its address: a fake tensor's
    storage has no address, NOTE [fake eager] in meshlm/core/state.py) and its offset in it.  Equal for
    two tensors exactly when their data pointers are."""
    return compat.storage_key(t.untyped_storage()), t.storage_offset()


def storage_bytes(ts: Iterable, seen: set[int]) -> int:
    """Bytes of the storages of ``ts`` (None skipped) not already in ``seen`` (storages,
    by identity: ``where``; updated): each storage counted once however many tensors view it."""
    n = 0
    for t in ts:
        if t is None:
            continue
        st = local_data(t).untyped_storage()
        if st.nbytes() and compat.storage_key(st) not in seen:
            seen.add(compat.storage_key(st))
            n += st.nbytes()
    return n


class PeakStorage(compat.TorchDispatchMode):
    """Peak bytes of live tensor storage: those ``seed`` holds, plus every storage an op
    returns while the mode is active (and ``tracking()`` is true), each until it is freed.

    An op's output that is a view of (or, in place, is) an input whose storage was live
    before the mode and is not in ``seed`` is not counted: the step did not allocate it (the
    data loader's slice of its epoch's permutation, a buffer's ``[:seq]``).

    A storage's bytes are read again after every op, not only when it is first seen: FSDP2
    and meshlm's ZeRO-3 blocks free gathered parameters with ``storage.resize_(0)`` and
    gather them again into the same storage (``resize_(n)``), which no op returns and no
    finalizer sees (counting each storage at its first size kept freed parameters live).

    NOTE [storage the backend frees]
        A collective's buffers are also referenced by the process group's work object, and
        gloo releases that on its own thread some time after the collective completed.  A
        buffer the program has already dropped then lives on for a moment that depends on
        thread timing, and the peak can include it or not from one run to the next (on
        this machine: 0 to 47 KB of a 0.4-0.6 MB step peak).  ``backend_slack`` bounds that
        effect exactly: the bytes of the storages that were live at the peak and were
        later freed by another thread.  Had the backend let go of each at once, the peak
        would lie in ``[peak - backend_slack, peak]``; an analytic or fake-tensor peak
        (which has no backend threads) is checked against that interval."""

    def __init__(self, seed=()):
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.sizes: dict[int, int] = {}
        self.cur = self.peak = 0
        self.ops = self.peak_op = 0  # ops seen; the op count when the peak was last raised
        self._born: dict[int, int] = {}  # storage -> the op count when it was tracked
        self._thread = threading.get_ident()
        self._late: list[tuple[int, int, int]] = []  # (born, freed, bytes) of storages freed off this thread
        for t in seed:
            self._track(t)
        self.base = self.cur

    def tracking(self) -> bool:
        """Whether the storages ops return now are counted (all of them, here)."""
        return True

    @property
    def backend_slack(self) -> int:
        """Bytes live at the peak that another thread (the backend's) freed later (NOTE
        [storage the backend frees])."""
        return sum(n for born, freed, n in list(self._late) if born <= self.peak_op < freed)

    def _free(self, key: int) -> None:
        self.live.pop(key, None)
        n = self.sizes.pop(key, 0)
        born = self._born.pop(key, 0)
        self.cur -= n
        if n and threading.get_ident() != self._thread:
            self._late.append((born, self.ops + 1, n))

    def _raise_peak(self) -> None:
        if self.cur > self.peak:
            self.peak, self.peak_op = self.cur, self.ops

    def _refresh(self) -> None:
        for key, ref in list(self.live.items()):  # a finalizer may run (and pop) meanwhile
            st = ref()
            n = st.nbytes() if st is not None else 0
            if key in self.sizes and n != self.sizes[key]:
                self.cur += n - self.sizes[key]
                self.sizes[key] = n

    def _track(self, t) -> None:
        t = local_data(t)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = compat.storage_key(st)
        if key in self.live:
            return
        self.live[key] = weakref.ref(st)
        self.sizes[key] = st.nbytes()
        self._born[key] = self.ops
        self.cur += st.nbytes()
        self._raise_peak()
        weakref.finalize(st, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self._refresh()
        self._raise_peak()
        if self.tracking():
            before = None  # the inputs' storages that were live before the mode and are not tracked
            for t in compat.tree_leaves(out):
                if before is None:
                    before = {k for k in map(_storage_key, compat.tree_leaves((args, kwargs))) if k not in self.live}
                if _storage_key(t) not in before:
                    self._track(t)
        return out


def _storage_key(t) -> "int | None":
    t = local_data(t)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    return compat.storage_key(t.untyped_storage())


def model_state_bytes(model, opt) -> dict[str, int]:
    """This rank's model state by kind, in bytes, each storage counted once (in this order):
    ``params`` (the model's parameters: local shards), ``grads`` (``.grad``, main gradients
    and the optimizer masters' ``.grad``) and ``optimizer`` (the masters that do not share a
    parameter's storage, and the inner optimizer's state)."""
    seen: set[int] = set()
    params = list(model.parameters())
    masters = list(opt.masters().values()) if hasattr(opt, "masters") else []
    inner = getattr(opt, "inner", opt)
    out = {"params": storage_bytes(params, seen)}
    out["grads"] = storage_bytes(
        [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params] + [m.grad for m in masters], seen
    )
    out["optimizer"] = storage_bytes(
        masters + [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)], seen
    )
    return out
