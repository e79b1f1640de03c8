"""A ``meshlm train`` launcher killed outright (kill -9, as the OOM killer does) takes its
workers with it within seconds, and they start no checkpoint save after it died (NOTE
[launcher death] in meshlm/app/watchdog.py); two runs started together on one checkpoint
directory: one trains, the other stops at once naming the holder of the directory's lock
(NOTE [one writer per checkpoint directory] in meshlm/train/checkpoint/lock.py).  Real ``meshlm train``
processes on 2 gloo workers; meshlm serve's launcher: tests/dist/test_serve_stop.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_run_lifecycle import _env, _here  # the environment of a meshlm command run from this checkout; one run here

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "model=llama_tiny",
    "layout=fsdp",
    "mesh=fsdp2",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.val_every=0",
    "train.val_batches=1",
    "train.progress=false",
    "train.pg_timeout_s=60",
    "train.log_every=1",
]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "meshlm.app.cli", "train", *RUN, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies, dead but not yet reaped, left out)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
        if int(fields[3]) == sid and fields[0] not in "ZX":
            out.append(int(d))
    return out


def gone_within(sid: int, seconds: float) -> tuple[bool, list[int]]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = session(sid)
        if not left:
            return True, []
        time.sleep(0.1)
    return False, session(sid)


def _steps(run_dir: Path) -> int:
    m = run_dir / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def _checkpoints(ck: Path) -> set[str]:
    return {n for n in os.listdir(ck) if n.startswith("step_")} if ck.exists() else set()


def test_workers_end_with_a_killed_launcher_and_save_nothing_after(tmp_path, capfd):
    ck = tmp_path / "ck"
    p = _start(
        tmp_path / "run", "train.steps=100000", f"checkpoint.dir={ck}", "checkpoint.every=4", "checkpoint.keep=0"
    )
    try:
        deadline = time.time() + 240
        while p.poll() is None and time.time() < deadline and not (_steps(tmp_path / "run") >= 5 and _checkpoints(ck)):
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-3000:]
        workers = [q for q in session(p.pid) if q != p.pid]
        assert len(workers) >= 2, workers  # 2 workers (and the forkserver)
        os.kill(p.pid, signal.SIGKILL)
        before = _checkpoints(ck)
        p.wait()
        gone, left = gone_within(p.pid, 10)
        assert gone, f"still running 10 s after the launcher was killed: {left}"
        time.sleep(1)
        new = _checkpoints(ck) - before
        # a save the kill caught half-way may have committed in the instant before the workers left
        assert len(new) <= 1, sorted(new)
        log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
        assert f"the launcher (pid {p.pid}) is gone; worker rank 0" in log
    finally:
        if session(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    # the dead run's lock (its workers died with it) is taken over by the next run, saying so
    # (that run on one device, in this process: the lock and the resume are what it shows)
    rc, out, err = _here(
        capfd,
        tmp_path / "run2",
        "train.steps=2",
        f"checkpoint.dir={ck}",
        "checkpoint.resume=auto",
        "checkpoint.every=0",
    )
    assert rc == 0, err[-3000:]
    assert f"took over {ck}/LOCK from pid " in out and f"on host {socket.gethostname()}" in out, out
    assert "nothing to do: the checkpoint resumed is at step" in out


def test_two_runs_into_one_checkpoint_directory_one_trains_the_other_stops(tmp_path):
    # 300 steps: the first to take the lock still trains when the other, started with it, gets there
    ck = tmp_path / "ck"
    runs = [
        _start(
            tmp_path / f"run{i}",
            "train.steps=300",
            f"checkpoint.dir={ck}",
            "checkpoint.resume=auto",
            "checkpoint.every=50",
            "checkpoint.keep=0",
        )
        for i in range(2)
    ]
    try:
        done: dict[int, float] = {}
        deadline = time.time() + 300
        while len(done) < 2 and time.time() < deadline:
            for i, r in enumerate(runs):
                if i not in done and r.poll() is not None:
                    done[i] = time.time()
            time.sleep(0.05)
        results = [(r.returncode, *r.communicate()) for r in runs]
    finally:
        for r in runs:
            if r.poll() is None or session(r.pid):
                os.killpg(r.pid, signal.SIGKILL)
    codes = sorted(rc for rc, _o, _e in results)
    assert codes == [0, 1], [(rc, e[-2000:]) for rc, _o, e in results]
    win = next(i for i, (rc, _o, _e) in enumerate(results) if rc == 0)
    lose = 1 - win
    err = results[lose][2]
    [line] = [ln for ln in err.splitlines() if "in use by another run" in ln]
    holder = runs[win]
    assert f"checkpoint.dir='{ck}' is in use by another run: pid " in line
    assert f"on host {socket.gethostname()} (run dir {tmp_path / f'run{win}'}, since " in line, line
    assert "Traceback" not in err
    assert done[lose] < done[win]  # it stopped at once, while the other one trained
    assert not (tmp_path / f"run{lose}" / "metrics.jsonl").exists()
    # the winner's checkpoints are all there, of its run, whole
    metas = [json.loads((ck / f"step_{s:08d}" / "meta.json").read_text()) for s in range(50, 301, 50)]
    assert sorted(os.listdir(ck)) == ["LOCK", "run.json"] + [f"step_{s:08d}" for s in range(50, 301, 50)]
    assert len({m["run_id"] for m in metas}) == 1
    assert (ck / "LOCK").read_text() == ""  # released at the end
    assert holder.returncode == 0
