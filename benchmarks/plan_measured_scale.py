"""CPU seconds of ``meshlm plan`` with the measured method at scale, and of its start
(docs/plan.md, "Speed"):

    python benchmarks/plan_measured_scale.py

Runs each command below as its own process and prints its CPU seconds (user + system, from
``resource.getrusage(RUSAGE_CHILDREN)``: what the process cost, whatever else the machine
runs) and its wall seconds, against the target:

- ``start``: the whole of a one-candidate formula plan of llama_tiny, an upper bound on the
  command's start (Python, torch, meshlm, Hydra, the config): target 3 s;
- ``8b``: Llama 3 8B, fsdp on 1,024 ranks, seq 128, float32, measured: target 30 s;
- ``405b``: Llama 3 405B, fsdp_tp_sp on 16,384 ranks (dp 16 x fsdp 128 x tp 8), global
  batch 2,048 x seq 8,192, bf16 compute, full checkpointing, measured: target 60 s.

The measured ones count blocks (NOTE [counted blocks] in meshlm/plan/repeats.py).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = [
    ("start", 3.0, ["model=llama_tiny", "layout=ddp", "mesh=dp2", "plan.method=formula"]),
    (
        "8b",
        30.0,
        ["model=llama3_8b", "layout=fsdp", "mesh.dp=1", "mesh.fsdp=1024", "mesh.tp=1"]
        + ["train.batch_size=1024", "train.seq_len=128", "plan.profile=cpu"],
    ),
    (
        "405b",
        60.0,
        ["model=llama3_405b", "layout=fsdp_tp_sp", "mesh.dp=16", "mesh.fsdp=128", "mesh.tp=8"]
        + ["train.batch_size=2048", "train.seq_len=8192", "train.param_dtype=bfloat16"]
        + ["train.activation_checkpointing=full", "plan.profile=h100_nvlink_ib"],
    ),
]


def cpu_of(args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``meshlm plan ARGS`` in a process of its own."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "meshlm.app.cli", "plan", *args], check=True, env=env, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


if __name__ == "__main__":
    for name, target, args in CASES:
        cpu, wall = cpu_of(args)
        verdict = "ok" if cpu < target else "OVER"
        print(
            f"{name:6} {cpu:7.2f} s CPU {wall:7.2f} s wall   target {target:g} s CPU: {verdict}   meshlm plan {' '.join(args)}"
        )
