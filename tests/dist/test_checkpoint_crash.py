"""Crash safety with real SIGKILLs of a real 2-process training job (tests/dist/ckpt_driver.py):
the job resumes from the last complete checkpoint and its loss curve equals, bit for bit,
that of an uninterrupted run of the same seed (CPU, same world size: no reordering).  The
same through ``meshlm train`` itself: tests/dist/test_run_lifecycle.py
(``test_sigkill_of_the_whole_job_resumes_exactly``)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_driver.py")
STEPS = 8


def _run(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, DRIVER, "--steps", str(STEPS), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, **kw)


def _wait(p: subprocess.Popen, want: int, what: str = "", timeout: float = 240) -> None:
    """Wait for the job and assert its exit code is ``want``; on any other code the message
    carries the job's stderr (a failure in CI must say why, not just ``1 != 0``)."""
    try:
        _out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == want, (
        f"exit code {p.returncode}, expected {want} {what}\n--- stderr (tail) ---\n"
        + err.decode(errors="replace")[-6000:]
    )


def _losses(log: str) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    with open(log) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:  # a line cut by the kill has no loss
                out.setdefault(int(parts[0]), set()).add(parts[1])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    p = _run(["--dir", str(d / "ckpt"), "--log", str(d / "loss.log")])
    _wait(p, 0)
    ref = _losses(str(d / "loss.log"))
    assert sorted(ref) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in ref.values())
    return ref


def _assert_same_curve(log: str, ref: dict) -> None:
    got = _losses(log)
    assert sorted(got) == sorted(ref), f"steps logged {sorted(got)}"
    for step, values in got.items():
        # every time a step ran (before the kill and again after the resume) it gave the
        # reference loss exactly
        assert values == ref[step], f"step {step}: losses {values} != uninterrupted {ref[step]}"


def test_sigkill_during_save_resumes_exactly(tmp_path, reference):
    ck, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.log")
    # rank 1 SIGKILLs itself inside the save of step 6, after writing its shard
    _wait(_run(["--dir", ck, "--log", log, "--die-in-save", "6"]), 1)
    names = sorted(os.listdir(ck))
    assert "step_00000004" in names and "step_00000006" not in names, names
    assert any(n.startswith(".tmp_step_00000006") for n in names), names  # the torn save, never visible
    _wait(_run(["--dir", ck, "--log", log, "--resume", "auto"]), 0)
    _assert_same_curve(log, reference)
    assert _losses(log).keys() == reference.keys()
    assert sorted(os.listdir(ck)) == ["LOCK", "run.json", "step_00000006", "step_00000008"]  # keep=2, torn dir removed


def test_sigkill_at_random_moment_resumes_exactly(tmp_path, reference):
    ck, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.log")
    p = _run(["--dir", ck, "--log", log, "--sleep", "0.2"])
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:  # wait for the first checkpoint
        if os.path.isdir(os.path.join(ck, "step_00000002")):
            break
        time.sleep(0.05)
    delay = random.Random(os.getpid()).uniform(0.0, 1.0)
    time.sleep(delay)  # then any moment: a step or a save
    first = p.poll()  # None: still running, so killed now
    if first is None:
        os.killpg(p.pid, signal.SIGKILL)
    first_err = p.communicate()[1].decode(errors="replace")[-3000:]
    left = sorted(os.listdir(ck)) if os.path.isdir(ck) else None
    what = f"(resume after a kill {delay:.3f} s after step_00000002 appeared; first job exit {first}; it left {left})"
    if first not in (None, 0):
        what += "\n--- first job's stderr (tail) ---\n" + first_err
    _wait(_run(["--dir", ck, "--log", log, "--resume", "auto"]), 0, what)
    _assert_same_curve(log, reference)
