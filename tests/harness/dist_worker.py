"""The worker side of harness.dist: what each spawned process runs (join a gloo
process group, run jobs, send results and failures back), and the messages and failures
the parent and workers share.  The parent side, and how to use the harness, is dist.py (its
handle on the worker processes: dist_procs.py)."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

# torch is imported lazily, in the parent when a pool starts and in a worker after `env` is
# applied, so that `env` can set variables torch reads at import (OMP_NUM_THREADS, TORCH_LOGS).

_WORKER_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
# Control messages from the parent. Jobs are pickles, which start with b"\x80", never these.
_JOIN = b"join:"  # + "<store port> <gloo timeout s>": (re)join a process group
_STOP = b"stop"
_READY = b"ready"
_JOINED = b"joined"


class WorkerError(RuntimeError):
    """`fn` raised on at least one rank.

    Attributes: `ranks` (the failing ranks, sorted), `rank` (the root-cause rank),
    `exc_type` (its exception type, qualified unless a builtin) and `remote_traceback`.
    """

    def __init__(self, message: str, ranks: list[int], rank: int, exc_type: str, remote_traceback: str):
        super().__init__(message)
        self.ranks = ranks
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class _Failure:
    rank: int
    exc_type: str
    message: str
    traceback: str
    time: float  # time.time() in the worker; all ranks share one clock
    is_comm: bool  # a gloo timeout or a peer gone: usually a consequence, not a cause

    def headline(self) -> str:
        first_line = self.message.splitlines()[0] if self.message else ""
        return f"rank {self.rank}: {self.exc_type}: {first_line}"


# --- worker side ---


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    # Gloo reports timeouts and dead peers as a plain RuntimeError whose message names a
    # gloo source file: "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting".
    return isinstance(exc, dist.DistError) or "/gloo/" in str(exc)


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        # Look DTensor up instead of importing it: the import costs a second per worker.
        dtensor_module = sys.modules.get("torch.distributed.tensor")
        if dtensor_module is not None and isinstance(obj, dtensor_module.DTensor):
            raise TypeError("fn returned a DTensor: return x.full_tensor() or x.to_local() instead")
        # copy=True also compacts views, so a slice does not ship its whole base storage.
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(x) for x in obj))
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _mutmut_state() -> Any:
    """mutmut's state while it maps tests to the functions they run (docs/mutation.md), else None.

    mutmut learns which tests cover a function from the hits its trampolines record in the
    pytest process. A job runs in a worker, so the worker sends its hits back with the result
    and the parent adds them to the running test's. Inert unless MUTANT_UNDER_TEST=stats.
    """
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return None
    try:
        from mutmut.state import state
    except ImportError:
        return None
    return state()


def _mutmut_hits() -> list[str]:
    """The functions this worker ran since the last call, under mutmut's stats (else [])."""
    mutmut_state = _mutmut_state()
    if mutmut_state is None:
        return []
    hits = sorted(mutmut_state._stats)
    mutmut_state._stats.clear()
    return hits


def _run_job(rank: int, job: bytes) -> bytes:
    try:
        fn, args, kwargs = pickle.loads(job)
        return pickle.dumps(("ok", _to_cpu(fn(*args, **kwargs)), _mutmut_hits()))
    except Exception as exc:  # everything goes back to the parent; KeyboardInterrupt ends the worker
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
            exc = exc.with_traceback(exc.__traceback__.tb_next)  # drop this frame: start at fn
        failure = _Failure(
            rank=rank,
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            time=time.time(),
            is_comm=_is_comm_error(exc),
        )
        return pickle.dumps(("err", failure, _mutmut_hits()))


def _join_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker_main(rank: int, world_size: int, conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(
        MESHLM_TEST_WORKER="1",
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # what a killed worker printed is not lost
    faulthandler.enable()  # a segfault prints the Python stack
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks before a kill

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # The parent sends the first join once every rank has imported torch, so that import
        # time on a busy machine does not count against a short gloo timeout.
        conn.send_bytes(_READY)
        while (msg := conn.recv_bytes()) != _STOP:
            if msg.startswith(_JOIN):  # b"join <port> <gloo timeout in seconds>"
                port, timeout = msg.removeprefix(_JOIN).split()
                _join_group(rank, world_size, int(port), float(timeout))
                conn.send_bytes(_JOINED)
            else:
                conn.send_bytes(_run_job(rank, msg))
        if dist.is_initialized():
            dist.destroy_process_group()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone: exit instead of lingering as an orphan
    # Leave without the interpreter's teardown (a spawned child runs it in full: every
    # module, torch's included, is torn down, ~0.7 s a worker, several seconds for a pool of
    # 4 on 2 cores). Nothing is left to finish: each job's results went back with it, and
    # its output streams are flushed here.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
