"""A multi-process gloo harness: spawn a process group once, run many test functions on it.

`DistPool(n)` starts `n` worker processes (multiprocessing "spawn"), each of which joins
one gloo process group on CPU and then waits for jobs. `pool.run(fn, *args, **kwargs)`
calls `fn(*args, **kwargs)` on every rank and returns the per-rank results, indexed by
rank. Inside `fn`, `torch.distributed` is initialised: use `dist.get_rank()`,
collectives, `init_device_mesh("cpu", ...)` as usual.

One pool per test module::

    import pytest
    import torch
    import torch.distributed as dist
    from harness.dist import DistPool

    @pytest.fixture(scope="module")
    def pool4():
        with DistPool(4, timeout_s=20) as p:
            yield p

    def _sum_ranks():  # module level, so that it pickles by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t

    def test_sum(pool4):
        assert [t.item() for t in pool4.run(_sum_ranks)] == [6.0] * 4

`pool4 = dist_pool_fixture(4, timeout_s=20)` builds the same fixture.

Rules for `fn` and its results:
- `fn`, its arguments and its results are pickled. `fn` must be a module-level function
  (no lambdas, no closures); each worker imports its module, so keep test modules cheap to
  import (pytest's default "prepend" import mode makes test modules importable by name). A
  script (not pytest) that makes a pool needs the `if __name__ == "__main__":` guard that
  "spawn" always needs.
- Tensors in the result (also inside lists, tuples and dicts) are detached, copied to the
  CPU and compacted before they are sent back. DTensors are not: return
  `x.full_tensor()` or `x.to_local()`.
- Workers have `MESHLM_TEST_WORKER=1`, `torch.set_num_threads(1)`, `OMP_NUM_THREADS=1` and
  `TORCHINDUCTOR_COMPILE_THREADS=1` (override the last two with `env=`). They print to the
  parent's stdout and stderr.

Failures, and why none of them hangs:
- An exception on any rank makes `run` raise `WorkerError` (a `RuntimeError`) that names
  the failing ranks and carries the remote traceback of the root cause: ordinary errors
  come before the gloo timeouts and "connection closed" errors they cause, then the
  earliest wins.
- `init_process_group` gets `timeout_s`, so a collective that not every rank enters (a
  deadlock) raises after `timeout_s`. The workers then join a fresh process group (no
  respawn), because the old one's collectives no longer line up across ranks.
- Ranks that have not answered `error_grace_s` after another rank failed are presumed stuck
  in a collective waiting for it, and are not waited for until the gloo timeout: every
  worker is killed (the stuck ones first dump their Python stacks to stderr) and the next
  `run` respawns them. The same happens when a worker dies or a job runs past
  `job_timeout_s`.
- `close()` (or leaving the `with` block) destroys the process group and ends the workers;
  a pool that is never closed is killed when it is garbage collected or at interpreter
  exit, and a worker whose parent died exits on its own.

A pool is not thread-safe: one `run` at a time.
"""

from __future__ import annotations

import multiprocessing.util as mp_util
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from harness.dist_procs import _exit_reason, _kill_workers, _WorkerDied, _Workers
from harness.dist_worker import (  # noqa: F401 (the worker side; re-exported for the tests)
    _JOIN,
    _JOINED,
    _READY,
    _STOP,
    _WORKER_ENV_DEFAULTS,
    WorkerError,
    _Failure,
    _is_comm_error,
    _join_group,
    _mutmut_hits,
    _mutmut_state,
    _run_job,
    _to_cpu,
    _worker_main,
)

__all__ = ["DistPool", "WorkerError", "dist_pool_fixture", "run_distributed"]


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class DistPool:
    """`world_size` spawned workers in one gloo process group on CPU, reused across `run`s.

    Args:
        world_size: number of ranks.
        timeout_s: gloo timeout given to `init_process_group`: how long a collective that
            not every rank enters blocks before it raises.
        env: extra environment variables for the workers, set before they import torch.
        job_timeout_s: wall-clock limit of one `run`.

    The attributes `job_timeout_s`, `error_grace_s` (how long to wait for the other ranks
    once one has failed) and `start_timeout_s` (worker start-up) may be changed at any time.
    """

    job_timeout_s: float = 120.0
    error_grace_s: float = 3.0
    start_timeout_s: float = 120.0

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        *,
        job_timeout_s: float | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"DistPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.env = {**_WORKER_ENV_DEFAULTS, **{k: str(v) for k, v in (env or {}).items()}}
        if job_timeout_s is not None:
            self.job_timeout_s = job_timeout_s
        self._closed = False
        # The finalizer reaches the workers through this list, never through self, so that a
        # forgotten pool can be collected. Its exitpriority runs it at interpreter exit before
        # multiprocessing joins its non-daemon children, which would wait forever.
        self._holder: list[_Workers | None] = [None]
        self._finalizer = mp_util.Finalize(self, _kill_workers, args=(self._holder,), exitpriority=100)
        self._respawn()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self.broken else "running")
        return f"DistPool(world_size={self.world_size}, timeout_s={self.timeout_s:g}, {state})"

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def broken(self) -> bool:
        """True once a failure killed the workers; the next `run` respawns them."""
        return not self._closed and self._holder[0] is None

    def close(self) -> None:
        """Destroy the process group and end the workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.cancel()
        workers, self._holder[0] = self._holder[0], None
        if workers is not None:
            workers.stop()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results indexed by rank.

        Raises `WorkerError` if `fn` raised on any rank, `RuntimeError` if a worker died or
        the job ran past `job_timeout_s`, `TypeError` if `fn` or its arguments do not pickle.
        """
        if self._closed:
            raise RuntimeError(f"{self!r}: run() after close()")
        name = _fn_name(fn)
        try:
            job = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"DistPool.run: cannot pickle {name} or its arguments ({exc}); fn must be a module-level "
                "function and its arguments picklable"
            ) from exc
        if self._holder[0] is None:
            self._respawn()
        try:
            return self._run(job, name)
        except WorkerError:
            raise  # _run left the pool usable, or killed it
        except BaseException:
            self._kill()  # workers left mid-job (Ctrl-C, say) must not answer the next job
            raise

    def _respawn(self) -> None:
        self._holder[0] = _Workers(self.world_size, self.timeout_s, self.env, self.start_timeout_s)

    def _kill(self, dump_stacks_of: Sequence[int] = ()) -> None:
        workers, self._holder[0] = self._holder[0], None
        if workers is not None:
            workers.kill(dump_stacks_of)

    def _run(self, job: bytes, name: str) -> list[Any]:
        workers = self._holder[0]
        assert workers is not None
        what = f"DistPool(world_size={self.world_size}): {name}"
        for rank, conn in enumerate(workers.conns):
            try:
                conn.send_bytes(job)
            except OSError:
                workers.procs[rank].join(1.0)
                reason = _exit_reason(workers.procs[rank].exitcode)
                raise RuntimeError(
                    f"{what}: rank {rank} had died ({reason}) before the job was sent; killed all workers, "
                    "the next run respawns them"
                ) from None
        results: list[Any] = [None] * self.world_size
        failures: list[_Failure] = []
        pending = set(range(self.world_size))
        deadline = time.monotonic() + self.job_timeout_s
        first_failure_at = 0.0
        while pending:
            wait_until = deadline if not failures else min(deadline, first_failure_at + self.error_grace_s)
            ready = workers.wait(pending, wait_until)
            if not ready:
                stuck = sorted(pending)
                self._kill(dump_stacks_of=stuck)
                if failures:
                    raise _worker_error(
                        what,
                        failures,
                        f"Ranks {stuck} had not answered {self.error_grace_s:g} s after rank "
                        f"{failures[0].rank} failed (blocked in a collective waiting for it?); killed all "
                        "workers, the next run respawns them; the stuck ranks' Python stacks are on stderr "
                        "above.",
                    )
                raise RuntimeError(
                    f"{what} did not finish within job_timeout_s={self.job_timeout_s:g} s on ranks "
                    f"{stuck}; killed all workers, the next run respawns them; their Python stacks are on "
                    "stderr above."
                )
            for rank in ready:
                try:
                    status, payload, hits = pickle.loads(workers.recv(rank))
                    if hits and (mutmut_state := _mutmut_state()) is not None:
                        mutmut_state._stats.update(hits)
                except _WorkerDied as exc:
                    self._kill(dump_stacks_of=sorted(pending - {rank}))
                    earlier = f" (ranks {sorted(f.rank for f in failures)} had raised)" if failures else ""
                    raise RuntimeError(
                        f"{what}: {exc}{earlier}; killed all workers, the next run "
                        "respawns them. The worker's stderr above says why."
                    ) from None
                except Exception as exc:  # a result that does not unpickle here
                    status = "err"
                    payload = _Failure(
                        rank,
                        type(exc).__name__,
                        f"the result did not unpickle: {exc}",
                        traceback.format_exc(),
                        time.time(),
                        False,
                    )
                pending.discard(rank)
                if status == "ok":
                    results[rank] = payload
                    continue
                if not failures:
                    first_failure_at = time.monotonic()
                failures.append(payload)
        if not failures:
            return results
        note = ""
        if all(f.is_comm for f in failures) and len(failures) < self.world_size:
            returned = sorted(set(range(self.world_size)) - {f.rank for f in failures})
            note = f"Ranks {returned} returned normally: did they skip a collective that the others entered?"
        error = _worker_error(what, failures, note)
        if any(f.is_comm for f in failures):
            # After a gloo timeout the ranks disagree on which collectives ran: start a new group.
            try:
                workers.join_group(self.timeout_s)
            except RuntimeError:
                self._kill()
        raise error


def _worker_error(what: str, failures: list[_Failure], note: str = "") -> WorkerError:
    """One error for a job that failed on some ranks, led by the root cause's traceback."""
    ranks = sorted(f.rank for f in failures)
    root = min(failures, key=lambda f: (f.is_comm, f.time))
    others = [f.headline() for f in sorted(failures, key=lambda f: f.rank) if f is not root]
    lines = [
        f"{what} raised on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}.",
        f"Root cause: {root.headline()}",
    ]
    if others:
        lines.append("Then: " + "; ".join(others))
    if note:
        lines.append(note)
    lines += [f"--- remote traceback of rank {root.rank} ---", root.traceback.rstrip()]
    return WorkerError("\n".join(lines), ranks, root.rank, root.exc_type, root.traceback)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60, **kwargs: Any
) -> list[Any]:
    """`fn(*args, **kwargs)` on a one-shot `DistPool(world_size, timeout_s)`; results by rank.

    Spawning costs seconds: a module that runs more than one job should share a `DistPool`.
    """
    with DistPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


def dist_pool_fixture(world_size: int, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Any:
    """A module-scoped pytest fixture that yields a `DistPool`: `pool4 = dist_pool_fixture(4)`.

    Modules that ask for the same pool (world size, timeout, env) share its workers: starting
    gloo workers costs seconds each time (NOTE [shared pools])."""
    import pytest

    @pytest.fixture(scope="module")
    def pool() -> Any:
        if os.environ.get("MESHLM_TEST_SHARED_POOLS", "1") == "0":
            with DistPool(world_size, timeout_s=timeout_s, env=env) as p:
                yield p
            return
        p = _shared_pool(world_size, timeout_s, env)
        yield p
        _between_modules(p)

    return pool


# NOTE [shared pools]: a test module's pool outlives the module, for the next module that
# asks for the same one: one pool per world size is kept (a request with another env closes
# the old one), so at most 1 + 2 + 4 + 8 idle workers stay up (the 8 workers' imports and
# first jobs cost tens of seconds on 2 cores, once per module before they were shared). Between modules the workers drop what the module left
# (`_reset_worker`: Dynamo's caches, DTensor's sharding caches, garbage) and join a new
# process group: destroying the old one ends every subgroup the module's meshes made (each
# keeps gloo threads; hundreds pile up otherwise). That needs the meshes gone too: the
# DTensor caches that hold them are cleared first (`compat.clear_dtensor_caches`), or the
# destroyed groups live on with threads that keep polling (it once left 620 threads in each
# idle worker, a core's worth of CPU). A request with another `timeout_s` keeps
# the workers and only forms their group again with the new gloo timeout (it is the group's,
# given at `init_process_group`; respawning costs seconds a time). A module whose job broke
# the pool leaves it broken, and its next run respawns the workers as always. Every pool is
# closed at interpreter exit (its finalizer). MESHLM_TEST_SHARED_POOLS=0 gives each module
# its own.
_SHARED: dict[int, tuple[tuple, DistPool]] = {}


def _shared_pool(world_size: int, timeout_s: float, env: dict[str, str] | None) -> DistPool:
    key = tuple(sorted((env or {}).items()))
    held = _SHARED.get(world_size)
    if held is not None and (held[0] != key or held[1]._closed):
        held[1].close()
        held = None
    if held is None:
        held = _SHARED[world_size] = (key, DistPool(world_size, timeout_s=timeout_s, env=env))
    pool = held[1]
    if pool.timeout_s != float(timeout_s):
        pool.timeout_s = float(timeout_s)  # a broken pool respawns with it; a live one joins anew
        if not pool.broken:
            try:
                pool._holder[0].join_group(pool.timeout_s)
            except Exception:  # workers that cannot join are not handed on: new ones start
                pool._kill()
    return pool


def _between_modules(pool: DistPool) -> None:
    if pool._closed or pool.broken:
        return
    try:
        pool.run(_reset_worker)
        pool._holder[0].join_group(pool.timeout_s)
    except Exception:  # a pool that cannot even reset is not handed on
        pool.close()


def _reset_worker() -> None:
    import gc

    from meshlm import _torch_compat as compat
    from meshlm.runtime.bucket import spec

    compat.dynamo_reset()
    compat.clear_dtensor_caches()
    spec.clear_registry()  # no model of the module is alive, and Dynamo forgot the indices
    gc.collect()
