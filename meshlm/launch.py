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

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from meshlm.config import RunConfig
from meshlm.errors import MeshlmError


class JobFailedError(MeshlmError):
    """A worker process failed; the message holds its root cause."""


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _root_cause(err: Any) -> str:
    rank, failure = err.get_first_failure()
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
        detail = f"exit code {failure.exitcode}" + (f" (signal {failure.signal_name()})" if failure.exitcode < 0 else "")
    out = f"worker rank {rank} (pid {failure.pid}) failed: {detail}"
    is_user_error = any(detail.startswith(n) for n in ("ConfigError", "MeshError", "LayoutError", "NonFiniteLossError",
                                                        "AxisError", "AnnotationError", "CheckpointError"))
    if tb and not is_user_error:
        out += "\n" + tb.rstrip()
    return out


def launch(cfg: RunConfig, run_dir: "str | os.PathLike") -> dict[str, Any] | None:
    """Run training under ``cfg`` with its output in ``run_dir``; return rank 0's summary
    (None when this process is not rank 0 of a launch it started)."""
    from meshlm.train import check_world, run

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if in_torchrun():
        return run(cfg, run_dir)
    n = cfg.mesh.size()
    if n == 1:
        import torch.distributed as dist

        try:
            return run(cfg, run_dir)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    check_world(cfg, n)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from meshlm.train import worker

    # The agent logs every failure and stack at ERROR level; we report the root cause once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)  # "terminating process ..." on a failure
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"timeout": 120},
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if env_threads is None:  # what torchrun does for more than one process per node
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    try:
        elastic_launch(lc, worker)(cfg, str(run_dir))
    except ChildFailedError as e:
        raise JobFailedError(_root_cause(e)) from None
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    p = run_dir / "summary.json"
    return json.loads(p.read_text()) if p.exists() else None
