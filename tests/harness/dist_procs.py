"""The parent's handle on one generation of DistPool's worker processes: spawn them, host
the rendezvous store and (re)form their gloo process group, wait for and receive their
messages, and stop or kill them.  What each worker runs is dist_worker.py; the pool that
runs jobs on them, and how to use the harness, is dist.py."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

# torch is imported lazily, in the parent when a pool starts and in a worker after `env` is
# applied, so that `env` can set variables torch reads at import (OMP_NUM_THREADS, TORCH_LOGS).

from harness.dist_worker import _JOIN, _JOINED, _READY, _STOP, _worker_main


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _WorkerDied(RuntimeError):
    pass


class _Workers:
    """One generation of worker processes, their pipes and the rendezvous store."""

    def __init__(self, world_size: int, timeout_s: float, env: dict[str, str], start_timeout_s: float):
        ctx = mp.get_context("spawn")
        self.store: Any = None
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                # Not a daemon, so that fn may start processes of its own (DataLoader workers);
                # DistPool's finalizer ends the workers instead.
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, child_end, env),
                    name=f"meshlm-dist-rank{rank}",
                )
                proc.start()
                child_end.close()  # so that a dead worker reads as EOF here
                self.procs.append(proc)
                self.conns.append(parent_end)
            self.collect(_READY, start_timeout_s, "start-up (import torch)")
            self.join_group(timeout_s)
        except BaseException:
            self.kill()
            raise

    def join_group(self, timeout_s: float) -> None:
        """(Re)form the process group on a new store."""
        import torch.distributed as dist

        # The parent hosts the store on a port the OS picks (port 0) and keeps it open, so no
        # concurrent test run can take the port between choosing and binding it.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        for conn in self.conns:
            conn.send_bytes(_JOIN + f"{self.store.port} {float(timeout_s)!r}".encode())
        self.collect(_JOINED, timeout_s + 30.0, "init_process_group")

    def collect(self, expected: bytes, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.procs)))
        while pending:
            ready = self.wait(pending, deadline)
            if not ready:
                raise RuntimeError(
                    f"DistPool: ranks {sorted(pending)} did not finish {what} within {timeout_s:.0f} s; "
                    "is the machine overloaded? (DistPool.start_timeout_s, timeout_s)"
                )
            for rank in ready:
                try:
                    msg = self.recv(rank)
                except _WorkerDied as exc:
                    raise RuntimeError(f"DistPool: {exc} during {what}; its stderr above says why") from None
                if msg != expected:
                    raise RuntimeError(f"DistPool: rank {rank} sent {msg[:40]!r} during {what}")
                pending.discard(rank)

    def wait(self, ranks: set[int], deadline: float) -> list[int]:
        """The ranks among `ranks` that sent something or died, waiting until `deadline`."""
        handles = {self.conns[r]: r for r in ranks} | {self.procs[r].sentinel: r for r in ranks}
        ready = mp_connection.wait(list(handles), timeout=max(0.0, deadline - time.monotonic()))
        return sorted({handles[h] for h in ready})

    def recv(self, rank: int) -> bytes:
        try:
            return self.conns[rank].recv_bytes()
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            raise _WorkerDied(f"rank {rank} died ({_exit_reason(self.procs[rank].exitcode)})") from None

    def kill(self, dump_stacks_of: Sequence[int] = ()) -> None:
        for rank in dump_stacks_of if hasattr(signal, "SIGUSR1") else ():
            proc = self.procs[rank]
            if proc.is_alive():
                sys.stderr.write(f"--- DistPool: Python stacks of stuck rank {rank} (pid {proc.pid}) ---\n")
                sys.stderr.flush()
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
                time.sleep(0.3)  # let faulthandler write them before the next rank's
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._reap()

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._reap()

    def _reap(self) -> None:
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.store = [], [], None


def _kill_workers(holder: list[_Workers | None]) -> None:
    workers, holder[0] = holder[0], None
    if workers is not None:
        workers.kill()
