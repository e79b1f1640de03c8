"""Start the worker processes of a run, or join the world a launcher already started.

* Inside torchrun (RANK and WORLD_SIZE set): this process is one rank; train in it.
* A one-device mesh: train in this process.
* Otherwise: start one worker per mesh device through torch's elastic launcher, as
  ``torchrun --standalone --nproc-per-node N`` would (c10d rendezvous on a free local
  port, no restarts).  When a worker fails, the agent stops the others at once and this
  process raises :class:`JobFailedError` carrying the root cause (the first failure,
  from the worker's error file), so it is reported once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from meshlm import _ckpt_lock
from meshlm.config import RunConfig
from meshlm.errors import MeshlmError


class JobFailedError(MeshlmError):
    """A worker process failed; the message holds its root cause."""


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Messages of a worker that failed only because another one did (its peer's sockets closed
# or the agent stopped it): never the root cause while a worker failed for its own reason.
_SECONDARY = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "communicator was aborted",
    "Broken pipe",
)


def _first_failure(err: Any) -> tuple[int, Any]:
    """The root-cause failure: the earliest one that is not a consequence of another
    (error-file timestamps have one-second resolution, so a peer that saw the connection
    close in the same second would otherwise win the tie by its lower rank)."""
    failures = getattr(err, "failures", None)
    if not failures:
        return err.get_first_failure()
    failures = {**_sibling_failures(failures), **failures}

    def key(item):
        rank, f = item
        text = json.dumps(f.message) if isinstance(f.message, dict) else str(f.message or "")
        has_message = bool(text) and not text.startswith("To enable traceback")
        # a worker with its own error message first (a worker stopped by a signal after
        # writing it still counts), then ones without, secondary symptoms last
        return (any(s in text for s in _SECONDARY), not has_message, f.timestamp, rank)

    return min(failures.items(), key=key)


def _sibling_failures(failures: dict) -> dict:
    """Failures recorded in the error files of ranks the agent stopped before it saw them
    fail: the agent reports only the workers it found failed, which under a race can be
    the peer that saw the connection close and not the worker that closed it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out: dict = {}
    for f in failures.values():
        ef = Path(f.error_file or "")
        if not ef.name or not ef.parent.parent.is_dir():
            continue
        for d in ef.parent.parent.iterdir():
            other = d / ef.name
            if d.name.isdigit() and int(d.name) not in failures and other.is_file():
                try:
                    out[int(d.name)] = ProcessFailure(local_rank=int(d.name), pid=0, exitcode=1, error_file=str(other))
                except Exception:  # noqa: BLE001 - a half-written file: not a root cause
                    continue
    return out


def _root_cause(err: Any) -> str:
    rank, failure = _first_failure(err)
    msg = failure.message
    detail = ""
    if isinstance(msg, dict):
        inner = msg if "extraInfo" in msg else msg.get("message", msg)
        if isinstance(inner, dict):
            detail = inner.get("message", "")
            tb = (inner.get("extraInfo") or {}).get("py_callstack", "")
        else:
            detail, tb = str(inner), ""
    else:
        detail, tb = str(msg or ""), ""
    if not detail or detail.startswith("To enable traceback"):
        detail = f"exit code {failure.exitcode}" + (
            f" (signal {failure.signal_name()})" if failure.exitcode < 0 else ""
        )
    out = f"worker rank {rank}" + (f" (pid {failure.pid})" if failure.pid else "") + f" failed: {detail}"
    is_user_error = any(
        detail.startswith(n)
        for n in (
            "ConfigError",
            "MeshError",
            "LayoutError",
            "NonFiniteLossError",
            "AxisError",
            "AnnotationError",
            "CheckpointError",
        )
    )
    if tb and not is_user_error:
        out += "\n" + tb.rstrip()
    return out


def _start_method() -> str:
    """How workers start (NOTE [start-up] in docs/train.md, "Start-up time"): ``forkserver``
    with ``meshlm.train`` preloaded, so torch and meshlm are imported once per job rather
    than once per worker; ``MESHLM_START_METHOD=spawn`` starts each worker from scratch."""
    import multiprocessing as mp

    method = os.environ.get("MESHLM_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        from meshlm.errors import ConfigError

        raise ConfigError(f"MESHLM_START_METHOD={method!r}: choose one of {', '.join(mp.get_all_start_methods())}")
    if method == "forkserver":
        mp.set_forkserver_preload(["meshlm.train"])
    return method


@contextlib.contextmanager
def _worker_threads(n: int):
    """OMP_NUM_THREADS for ``n`` workers on this node, as torchrun sets it, unless it is set."""
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if env_threads is None:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    try:
        yield
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def prestart(mesh: Mapping[str, Any]) -> None:
    """Start the forkserver of a job of ``mesh`` (the composed ``mesh`` section) now, so that
    it imports torch and meshlm while this process checks the config, which imports them
    too (NOTE [start-up]); ``launch`` then finds it running.  Nothing for a one-device mesh,
    a mesh with a ``-1`` axis (its size is the world's, known under torchrun only), under
    torchrun, or with another start method.  Idempotent: a sweep's jobs share the server."""
    import multiprocessing.forkserver

    if in_torchrun():
        return
    try:
        sizes = [int(v) for v in mesh.values()]
    except (TypeError, ValueError):
        return  # not sizes: the config check says so
    n = math.prod(sizes)
    if n <= 1 or min(sizes) < 1 or _start_method() != "forkserver":
        return
    with _worker_threads(n):
        multiprocessing.forkserver.ensure_running()


def launch(cfg: RunConfig, run_dir: "str | os.PathLike") -> dict[str, Any] | None:
    """Run training under ``cfg`` with its output in ``run_dir``; return rank 0's summary
    (None when this process is not rank 0 of a launch it started)."""
    from meshlm.train import check_world, run

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if in_torchrun() or cfg.mesh.size() == 1:
        import torch.distributed as dist

        if not in_torchrun():
            os.environ["MESHLM_LAUNCH_T0"] = str(time.time())  # the lifecycle.StartupClock
        try:
            return run(cfg, run_dir)
        finally:
            # Leave the process group before the interpreter exits (as worker() does): left to
            # interpreter shutdown, gloo's threads can be torn down in any order, and a rank
            # under torchrun once aborted there ("terminate called without an active exception").
            if dist.is_initialized():
                dist.destroy_process_group()
            _ckpt_lock.release_all()  # a run that failed leaves checkpoint.dir to the next one
    t0 = time.time()  # the workers' lifecycle.StartupClock
    os.environ["MESHLM_LAUNCH_T0"] = str(t0)
    n = cfg.mesh.size()
    check_world(cfg, n)
    from torch.distributed.elastic.multiprocessing import SignalException

    from meshlm.train import worker

    try:
        run_workers(n, worker, cfg, str(run_dir), t0)
    except SignalException as e:
        # SIGTERM/SIGINT to this process: the agent has passed it on to the workers and waited
        # for them to save and stop (NOTE [stopping on a signal] in meshlm/lifecycle.py)
        p = run_dir / "summary.json"
        out = json.loads(p.read_text()) if p.exists() else {}
        out["stopped_by"] = out.get("stopped_by") or signal.Signals(e.sigval).name
        return out
    p = run_dir / "summary.json"
    return json.loads(p.read_text()) if p.exists() else None


def run_workers(n: int, fn: Any, *args: Any) -> None:
    """``fn(*args)`` in ``n`` worker processes started as ``torchrun --standalone
    --nproc-per-node n`` would; a worker's failure raises :class:`JobFailedError` with the
    root cause (``fn`` must be importable: the workers import it by name)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every failure and stack at ERROR level; we report the root cause once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL)
    # "Received 15 death signal, shutting down workers": the run says what it did on a signal
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "terminating process ..." on a failure
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=_start_method(),
    )
    try:
        with _worker_threads(n):
            elastic_launch(lc, fn)(*args)
    except ChildFailedError as e:
        raise JobFailedError(_root_cause(e)) from None
