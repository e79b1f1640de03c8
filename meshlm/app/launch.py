"""Start the worker processes of a run, or join the world a launcher already started.

* Inside torchrun (RANK and WORLD_SIZE set): this process is one rank; train in it.
* A one-device mesh: train in this process.
* Otherwise: start one worker per mesh device through torch's elastic launcher, as
  ``torchrun --standalone --nproc-per-node N`` would (c10d rendezvous on a free local
  port, no restarts).  When a worker fails, the agent stops the others at once and this
  process raises :class:`JobFailedError` carrying the root cause (the first failure,
  from the worker's error file), so it is reported once.  A worker also ends when this
  process is killed outright (NOTE [launcher death] in meshlm/app/watchdog.py).
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

from meshlm.app.config import RunConfig
from meshlm.core.errors import MeshError, MeshlmError
from meshlm.train.checkpoint import lock as _ckpt_lock


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
                    # parse it here first: torch logs a traceback for a file it cannot parse,
                    # and a half-written one (its writer still running) is no root cause
                    json.loads(other.read_text())
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
    """How workers start (docs/train.md, "Start-up time"): ``forkserver``
    with ``meshlm.app.train`` preloaded, so torch and meshlm are imported once per job rather
    than once per worker; ``MESHLM_START_METHOD=spawn`` starts each worker from scratch."""
    import multiprocessing as mp

    method = os.environ.get("MESHLM_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        from meshlm.core.errors import ConfigError

        raise ConfigError(f"MESHLM_START_METHOD={method!r}: choose one of {', '.join(mp.get_all_start_methods())}")
    if method == "forkserver":
        mp.set_forkserver_preload(["meshlm.app.train"])
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


# NOTE [local process limit]
#     The local launcher starts one process per mesh device on this machine, and some meshes
#     cannot be hosted that way; they are refused before any process starts, with the limit
#     that binds (``local_limit``), rather than failing deep inside the launcher:
#     * the fork server (the default start method) receives a new process's file descriptors
#       in one message of at most ``multiprocessing.forkserver.MAXFDS_TO_SEND`` (256), and
#       torch's elastic launcher hands every worker the two pipe ends of every worker's result
#       queue, so 2 n + 4 must stay below it: n <= 125 ("ValueError: too many fds" otherwise);
#     * the open-file limit (``ulimit -n``): the launcher holds those 2 n pipe ends, and every
#       worker inherits them and opens a gloo socket to every other rank, ~4 per worker with
#       room for the rest;
#     * memory: ``_WORKER_MIB`` per worker, a floor (a worker of llama_tiny under layout=ddp
#       mesh=dp4 on CPU, torch 2.13, fork server: 63 MiB private, 103 MiB PSS; its model,
#       activations and gloo's buffers to more peers come on top).
#     CPU cores are not a limit: more workers than cores run, slower (the tests run 8 on 2).
#     ``meshlm plan`` (a fake process group in one process) starts no workers and is not
#     limited; a mesh larger than one machine runs under torchrun across nodes.
_WORKER_MIB = 128


def local_limit(start_method: str) -> tuple[int, str]:
    """The most worker processes this machine can start at once for one job, and why
    (NOTE [local process limit])."""
    import multiprocessing.forkserver
    import resource

    limits = []
    if start_method == "forkserver":
        cap = multiprocessing.forkserver.MAXFDS_TO_SEND
        limits.append(
            (
                (cap - 5) // 2,
                f"the fork server passes a new process at most {cap} file descriptors, 2 per worker "
                "(MESHLM_START_METHOD=spawn lifts this, at the cost of a slower start)",
            )
        )
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limits.append(((soft - 64) // 4, f"the open-file limit is {soft} (ulimit -n), about 4 per worker"))
    try:
        mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError, AttributeError):
        mib = 0
    if mib:
        limits.append((mib // _WORKER_MIB, f"{mib / 1024:.0f} GiB of memory, {_WORKER_MIB} MiB per worker at least"))
    return min(limits, default=(2**31, "no limit known"))


def check_local(n: int, label: str = "the mesh", key: str = "mesh") -> None:
    """Refuse to start ``n`` local worker processes where this machine cannot host them
    (NOTE [local process limit]): a MeshError naming ``label`` (the mesh), the config key or
    flag ``key`` that sets it, the size and the limit."""
    limit, why = local_limit(_start_method())
    if n > limit:
        raise MeshError(
            f"{label} needs {n} worker processes but this machine can start at most {limit} ({why}); set a "
            f"smaller {key}, plan a mesh this large without running it with `meshlm plan`, or run it under "
            "torchrun across nodes (docs/train.md, Multi-node)"
        )


def prestart(mesh: Mapping[str, Any]) -> None:
    """Start the forkserver of a job of ``mesh`` (the composed ``mesh`` section) now, so that
    it imports torch and meshlm while this process checks the config, which imports them
    too (docs/train.md, "Start-up time"); ``launch`` then finds it running.  Nothing for a one-device mesh,
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
    if n <= 1 or min(sizes) < 1 or _start_method() != "forkserver" or n > local_limit("forkserver")[0]:
        return  # (too many processes: launch says so)
    with _worker_threads(n):
        multiprocessing.forkserver.ensure_running()


def launch(cfg: RunConfig, run_dir: "str | os.PathLike") -> dict[str, Any] | None:
    """Run training under ``cfg`` with its output in ``run_dir``; return rank 0's summary
    (None when this process is not rank 0 of a launch it started)."""
    from meshlm.app.config import check_checkpoint_dir
    from meshlm.app.train import check_world, run

    check_checkpoint_dir(cfg.checkpoint.dir)  # before any worker starts: one line, not a worker's traceback
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
    n = cfg.mesh.size()
    check_local(n, f"mesh {cfg.mesh}")  # before any process starts (NOTE [local process limit])
    t0 = time.time()  # the workers' lifecycle.StartupClock
    os.environ["MESHLM_LAUNCH_T0"] = str(t0)
    check_world(cfg, n)
    from meshlm.app.train import worker

    stopped = run_workers(n, worker, cfg, str(run_dir), t0)
    p = run_dir / "summary.json"
    if stopped is not None:
        # SIGTERM/SIGINT to this process: the agent has passed it on to the workers and waited
        # for them to save and stop (NOTE [stopping on a signal] in meshlm/train/lifecycle.py)
        out = json.loads(p.read_text()) if p.exists() else {}
        if not out.get("stopped_by"):  # the workers did not stop on it (rank 0 said nothing): say it here
            out["stopped_by"] = signal.Signals(stopped).name
            out["stop_line"] = stop_line(cfg, run_dir, out, stopped)
        return out
    return json.loads(p.read_text()) if p.exists() else None


def stop_line(cfg: RunConfig, run_dir: Path, summary: Mapping[str, Any], signum: int) -> str:
    """What a run that ``signum`` stopped did, when its workers did not say it themselves
    (stopped before their loop, or by a repeated signal at once): the steps done (its
    metrics), the latest checkpoint in ``checkpoint.dir``, the exit status."""
    name = signal.Signals(signum).name
    if "global_step" in summary:
        done = f"after its last step ({summary['global_step']} of {cfg.train.steps})"
    else:
        steps = []
        m = run_dir / "metrics.jsonl"
        for line in m.read_text().splitlines() if m.exists() else []:
            with contextlib.suppress(ValueError):
                steps.append(int(json.loads(line).get("step") or 0))
        done = f"at global step {max(steps)} of {cfg.train.steps}" if steps else "before the first step"
    c = cfg.checkpoint
    if not c.dir:
        saved = "no checkpoint saved (checkpoint.dir is not set)"
    else:
        from meshlm.train.checkpoint import latest_checkpoint

        latest = latest_checkpoint(c.dir)
        saved = (
            f"latest checkpoint {latest}; continue with checkpoint.dir={c.dir} checkpoint.resume=auto"
            if latest
            else f"no checkpoint in checkpoint.dir={c.dir}"
        )
    return f"stopped by {name} {done}; {saved}; exit status {128 + signum}"


def run_workers(n: int, fn: Any, *args: Any) -> "int | None":
    """``fn(*args)`` in ``n`` worker processes started as ``torchrun --standalone
    --nproc-per-node n`` would; a worker's failure raises :class:`JobFailedError` with the
    root cause (``fn`` must be importable: the workers import it by name).  Returns None,
    or the signal (SIGTERM, SIGINT, ...) that stopped this process, after the agent passed
    it on to the workers and waited for them to stop.  Each worker ends with this process,
    however it dies (NOTE [launcher death] in meshlm/app/watchdog.py)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from meshlm.app.watchdog import watched

    # The agent logs every failure and stack at ERROR level; we report the root cause once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL)
    # "Received 15 death signal, shutting down workers": the run says what it did on a signal
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "terminating process ..." on a failure
    check_local(n)
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
            elastic_launch(lc, watched)(fn, *args)
    except ChildFailedError as e:
        raise JobFailedError(_root_cause(e)) from None
    except SignalException as e:
        first = e
        while isinstance(first.__context__, SignalException):
            first = first.__context__
        if first is not e:
            # a second signal cut the agent's wait for the workers short: they may be saving
            _see_workers_out()
        return int(first.sigval)
    return None


def _see_workers_out(timeout: float = 30.0) -> None:
    """Wait for the workers still running (they are saving) to end, ignoring further
    SIGTERM/SIGINT meanwhile; after ``timeout`` seconds (the agent's own), kill them.
    Returning at once would leave them to their watchdog (NOTE [launcher death] in
    meshlm/app/watchdog.py), which stops them mid-save."""
    import multiprocessing

    procs = [p for p in multiprocessing.active_children() if p.is_alive()]
    old = {s: signal.signal(s, lambda _signum, _frame: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
