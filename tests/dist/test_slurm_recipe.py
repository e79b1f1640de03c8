"""examples/slurm.sbatch (docs/train.md, "SLURM") as far as a CPU machine without SLURM
runs it: SLURM's variables set by hand, ``srun`` and ``scontrol`` replaced by small scripts
that record their arguments (srun then runs its command: one node), the real torchrun with
2 gloo workers.  SIGTERM to the batch script (what ``--signal=B:TERM@120`` sends) stops
the run with a checkpoint and requeues the job; the requeued job resumes and finishes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm.sbatch"
STEPS = 30
ARGS = ["model=llama_tiny", "layout=fsdp", "mesh=fsdp2", "train.seq_len=32", "train.batch_size=8",
        "train.val_every=0", "train.val_batches=1", "train.progress=false", "train.pg_timeout_s=60",
        f"train.steps={STEPS}"]

FAKE_SRUN = """#!/bin/bash
echo "$@" >> "$FAKE_LOG/srun.args"
while [[ "$1" == -* ]]; do shift; done   # srun's own options
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$FAKE_LOG/scontrol.args"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    if shutil.which("bash") is None or shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("needs bash and torchrun")
    d = tmp_path_factory.mktemp("slurm")
    (d / "bin").mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (d / "bin" / name).write_text(text)
        (d / "bin" / name).chmod(0o755)
    env = dict(os.environ, FAKE_LOG=str(d), RUN=str(d / "run"), NPROC="2", PORT=str(_free_port()), EVERY="0",
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="meshlm", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=os.pathsep.join([str(d / "bin"), os.path.dirname(sys.executable), os.environ["PATH"]]),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def start():
        return subprocess.Popen(["bash", str(SCRIPT), *ARGS], cwd=d, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def finish(p):
        try:
            out, _ = p.communicate(timeout=300)
            return p.returncode, out
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise

    p = start()
    metrics = d / "run" / "train" / "metrics.jsonl"
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be stopped"
    os.kill(p.pid, signal.SIGTERM)  # the batch script only, as --signal=B:TERM does
    first = finish(p)
    requeue_calls = (d / "scontrol.args").read_text().splitlines()
    listing = sorted(os.listdir(d / "run" / "ck"))
    second = finish(start())
    return {"dir": d, "first": first, "second": second, "requeue_calls": requeue_calls, "listing": listing}


def test_the_torchrun_command_line_comes_from_slurms_variables(job):
    args = (job["dir"] / "srun.args").read_text().splitlines()[0].split()
    assert args[:args.index("torchrun")] == ["--kill-on-bad-exit=1"]
    i = args.index("torchrun")
    want = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    assert args[i + 1:i + 1 + len(want)] == want
    assert args[args.index("--rdzv-endpoint") + 1].startswith("localhost:")
    assert args[args.index("--rdzv-id") + 1] == "4242"
    assert f"checkpoint.dir={job['dir'] / 'run' / 'ck'}" in args and "checkpoint.resume=auto" in args


def test_sigterm_saves_and_requeues(job):
    rc, out = job["first"]
    assert rc == 0, out[-4000:]
    assert "requeue 4242" in job["requeue_calls"], job["requeue_calls"]
    assert "stopped by SIGTERM" in out and "requeueing job 4242" in out
    assert len([n for n in job["listing"] if n.startswith("step_")]) == 1, job["listing"]


def test_the_requeued_job_resumes_and_finishes(job):
    rc, out = job["second"]
    assert rc == 0, out[-4000:]
    saved = [n for n in job["listing"] if n.startswith("step_")][0]
    assert f"resumed from step {int(saved[5:])}" in out
    assert f"global steps {int(saved[5:]) + 1}-{STEPS} of {STEPS}" in out
    s = json.loads((job["dir"] / "run" / "train" / "summary.json").read_text())
    assert s["global_step"] == STEPS
    assert (job["dir"] / "scontrol.args").read_text().count("requeue") == 1  # not requeued again
