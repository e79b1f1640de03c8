"""Swapping a tensor's storage out to a tier and back in, in place (NOTE [swapped storage]).

NOTE [swapped storage]
    An offloaded tensor keeps its identity (the same Python object, the same shape, dtype
    and DTensor wrapper, the same key in the optimizer's state), so that nothing that holds
    it (``inner.state``, checkpoints, the parity harness) needs to know.  Only its storage
    moves: ``swap_out`` copies the bytes to the tier and resizes the storage to 0 bytes (the
    memory is freed); ``swap_in`` resizes it back and copies the bytes in.  Between the two
    the tensor must not be read: ``ShardedOptimizer.resident()`` swaps everything in for a
    reader that needs it (a checkpoint save or load).

    - ``disk``: one file per tensor under a directory of its own for this run and rank
      (``SwapDir``), written with ``os.pwrite`` from the tensor's storage and read with
      ``os.preadv`` into it.  Not a memory mapping: the pages of a mapping that the step
      touches stay in the process's resident set until it is unmapped, while a storage of 0
      bytes holds nothing; a read into the tensor's own storage is also the one copy a
      mapping would make on first touch.
    - ``host``: on an accelerator, a pinned host copy (made once, reused).  On a CPU-only
      machine the device *is* host memory: nothing moves (``host`` is then accounting only),
      unless the swapper ``simulate``s an accelerator (tests of the host tier's code path).

    Only a tensor that owns its storage whole (contiguous, offset 0, storage exactly its
    bytes) is swapped; a view of a parameter (a same-dtype ZeRO-1/2 master, NOTE [optimizer
    chunks] in meshlm/runtime/optim/chunks.py) holds no memory of its own and stays.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import socket
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from meshlm.core.errors import ConfigError

_OWNER = ".owner"  # file in each rank's swap directory: "<host> <pid>"


def owns_storage(t: Tensor) -> bool:
    """True when ``t`` (a plain tensor) is its storage, whole: what can be swapped."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.numel() > 0
    )


def _bytes(t: Tensor):
    """A writable memoryview of contiguous CPU tensor ``t``'s bytes.  Not through
    ``.numpy()``, which marks the storage not resizable for as long as it lives."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SwapDir:
    """This run's and rank's swap files: ``<base>/run-<id>/rank<r>/``, removed by ``close``
    (and at interpreter exit).  ``run_id`` must be the same on every rank of a run and new
    for each run (``meshlm train`` uses the run's id); a rank's directory that exists
    already is an error, so two runs never share files.  Directories of ranks whose process
    is gone (killed) are removed when the next run on the host starts in the same base."""

    def __init__(self, base: "str | os.PathLike", rank: int = 0, run_id: Optional[str] = None):
        base = Path(base)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"offload.dir={str(base)!r}: cannot create the disk tier's directory ({e.strerror}); "
                "set offload.dir to a writable directory"
            ) from None
        _remove_stale(base)
        self.run_dir = base / f"run-{run_id or uuid.uuid4().hex[:12]}"
        self.path = self.run_dir / f"rank{rank}"
        try:
            self.path.mkdir(parents=True, exist_ok=False)
            (self.path / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
            probe = self.path / ".probe"
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except FileExistsError:
            raise ConfigError(f"offload.dir: {self.path} exists already; two runs would share swap files") from None
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise ConfigError(
                f"offload.dir={str(base)!r}: not writable ({e.strerror}); set offload.dir to a writable directory"
            ) from None
        self.base = base
        self._n = 0
        self._files: dict[int, str] = {}  # id(tensor) -> file
        atexit.register(self.close)
        _OPEN.add(self)

    def need(self, nbytes: int, what: str) -> None:
        """Raise ConfigError (and remove this rank's directory) when the file system has
        fewer than ``nbytes`` free for ``what``."""
        free = shutil.disk_usage(self.path).free
        if nbytes > free:
            self.close()
            raise ConfigError(
                f"offload.dir={str(self.base)!r}: {what} needs {nbytes / 2**20:.1f} MiB on this rank and the file "
                f"system has {free / 2**20:.1f} MiB free; free space, point offload.dir at a larger disk, or shard "
                "the optimizer state over more ranks (layout=zero1, zero2 or fsdp)"
            )

    def file_for(self, t: Tensor) -> str:
        f = self._files.get(id(t))
        if f is None:
            f = self._files[id(t)] = str(self.path / f"t{self._n}.bin")
            self._n += 1
        return f

    def drop(self, t: Tensor) -> None:
        """Remove ``t``'s file, if it has one."""
        f = self._files.pop(id(t), None)
        if f is not None:
            with contextlib.suppress(OSError):
                os.unlink(f)

    def write(self, t: Tensor, data: Tensor) -> None:
        """Write CPU tensor ``data`` (``t``'s bytes) to ``t``'s file."""
        view = _bytes(data)
        fd = os.open(self.file_for(t), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            done = 0
            while done < len(view):
                n = os.pwrite(fd, view[done:], done)
                if n <= 0:
                    raise OSError("short write")
                done += n
        except OSError as e:
            raise ConfigError(
                f"offload: writing to the disk tier {self.path} failed ({e}); the disk may be full"
            ) from None
        finally:
            os.close(fd)

    def read(self, t: Tensor, data: Tensor) -> None:
        """Read ``t``'s file into CPU tensor ``data``."""
        view = _bytes(data)
        fd = os.open(self._files[id(t)], os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise OSError(f"{self._files[id(t)]}: short read")
                done += n
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove this rank's files (and the run's directory once no rank has any left)."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.run_dir.rmdir()
        except OSError:
            pass  # another rank's files are still there

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self._files.values() if os.path.exists(f))


#: swap directories not yet closed, for ``close_all`` (a worker leaving through ``os._exit``)
_OPEN: "weakref.WeakSet[SwapDir]" = weakref.WeakSet()


def close_all() -> None:
    """Close every open swap directory of this process (its files are removed)."""
    for d in list(_OPEN):
        d.close()


def _remove_stale(base: Path) -> None:
    """Remove swap directories of ranks on this host whose process has exited (killed
    before it could clean up), and run directories left empty."""
    host = socket.gethostname()
    for d in base.glob("run-*/rank*"):
        try:
            h, pid = (d / _OWNER).read_text().split()
        except (OSError, ValueError):
            continue
        if h == host and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            try:
                d.parent.rmdir()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_empty(shape, dtype) -> Tensor:
    """An uninitialised host tensor, pinned where there is an accelerator to copy to and from."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class Swapper:
    """Swaps tensors' storages out to a tier and back (NOTE [swapped storage])."""

    def __init__(self, tier: str, disk: Optional[SwapDir] = None, simulate: bool = False):
        """``simulate``: CPU tensors are treated as an accelerator's (``host`` makes host copies
        and frees their storage, and the optimizer steps on the host, NOTE [host step]): the
        host tier's code path, run and checked on a machine without one."""
        self.tier = tier
        self.disk = disk
        self.simulate = simulate
        self._host: dict[int, Tensor] = {}  # id(tensor) -> pinned host copy
        self._out: dict[int, int] = {}  # id(tensor) -> its storage's bytes, while swapped out
        self._written: set[int] = set()  # id(tensor): has a copy on the tier
        self._pending: dict[int, Any] = {}  # id(tensor) -> the future of a read started ahead of use
        self.bytes_out = 0  # bytes written to the tier (a step's traffic: out and back in)
        self.bytes_in = 0
        self.seconds_out = 0.0  # wall time spent moving them (the transfer part of an offloaded step)
        self.seconds_in = 0.0

    def moves(self, t: Tensor) -> bool:
        """Whether swapping ``t`` frees memory here (host on a CPU tensor does not)."""
        return self.tier == "disk" or (self.tier == "host" and (t.device.type != "cpu" or self.simulate))

    def host_of(self, t: Tensor) -> Optional[Tensor]:
        """The host copy holding ``t``'s bytes while ``t`` is out on the ``host`` tier, or None."""
        return self._host.get(id(t)) if self.tier == "host" and self.is_out(t) else None

    def adopt(self, t: Tensor, host: Tensor) -> None:
        """Make ``host`` (a host tensor of ``t``'s shape and dtype) ``t``'s copy on the host
        tier, and free ``t``'s storage: ``t`` is out, with ``host``'s bytes (optimizer state the
        host step made, NOTE [host step])."""
        self._host[id(t)] = host
        self._written.add(id(t))
        st = t.untyped_storage()
        self._out[id(t)] = st.nbytes()
        st.resize_(0)

    def is_out(self, t: Tensor) -> bool:
        return id(t) in self._out

    def swap_out(self, t: Tensor, clean: bool = False) -> None:
        """Move ``t``'s bytes to the tier and free its storage.  ``clean``: the caller knows
        ``t`` has not changed since it came in, so the copy on the tier (if any) is kept
        and nothing is written (a parameter after its block's forward)."""
        if id(t) in self._pending:  # read ahead and never used: it is in memory again
            self.swap_in(t)
        if self.is_out(t) or not self.moves(t) or not owns_storage(t):
            return
        st = t.untyped_storage()
        nbytes = st.nbytes()
        if not (clean and id(t) in self._written):
            t0 = time.perf_counter()
            with torch.no_grad():
                if self.tier == "disk":
                    self.disk.write(t, t if t.device.type == "cpu" else t.cpu())
                else:
                    h = self._host.get(id(t))
                    if h is None:
                        h = self._host[id(t)] = host_empty(t.shape, t.dtype)
                    h.copy_(t)
            self._written.add(id(t))
            self.bytes_out += nbytes
            self.seconds_out += time.perf_counter() - t0
        st.resize_(0)
        self._out[id(t)] = nbytes

    def swap_in(self, t: Tensor) -> None:
        """Bring ``t``'s bytes back into its storage (waiting for a read started by
        ``swap_in_async``).  The bytes go in under ``.data``: a parameter that autograd saved
        for backward keeps its version, so backward may read it (NOTE [offloaded parameters])."""
        pending = self._pending.pop(id(t), None)
        t0 = time.perf_counter()
        if pending is not None:
            pending.result()
            nbytes = self._out.pop(id(t))
        else:
            nbytes = self._out.pop(id(t), None)
            if nbytes is None:
                return
            t.untyped_storage().resize_(nbytes)
            with torch.no_grad():
                if self.tier == "disk":
                    if t.device.type == "cpu":
                        self.disk.read(t, t)
                    else:
                        buf = torch.empty(t.shape, dtype=t.dtype)
                        self.disk.read(t, buf)
                        t.data.copy_(buf)
                else:
                    t.data.copy_(self._host[id(t)], non_blocking=False)
        self.bytes_in += nbytes
        self.seconds_in += time.perf_counter() - t0

    def forget(self, t: Tensor) -> None:
        """``t`` is done with (a step's gradient at ``zero_grad``): its copy on the tier is
        dropped (its file removed), and a later tensor with the same ``id`` starts afresh."""
        pending = self._pending.pop(id(t), None)
        if pending is not None:
            pending.result()
        self._out.pop(id(t), None)
        self._written.discard(id(t))
        self._host.pop(id(t), None)
        if self.disk is not None:
            self.disk.drop(t)

    def swap_in_async(self, t: Tensor, pool) -> bool:
        """Start bringing ``t`` back in a thread of ``pool`` (a disk file into a CPU tensor;
        ``swap_in`` waits for it); False when there is nothing to start."""
        if id(t) not in self._out or id(t) in self._pending or self.tier != "disk" or t.device.type != "cpu":
            return False
        t.untyped_storage().resize_(self._out[id(t)])
        self._pending[id(t)] = pool.submit(self.disk.read, t, t)
        return True
