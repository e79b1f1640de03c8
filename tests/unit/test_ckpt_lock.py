"""One writer per checkpoint directory (NOTE [one writer per checkpoint directory] in
meshlm/train/checkpoint/lock.py): a lock another process holds refuses, naming it; the lock of a
process that died (kill -9) or a LOCK file naming a dead pid is taken over, saying whose it
was; a run's end empties the file; without flock, the file alone decides."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshlm.core.errors import CheckpointError
from meshlm.train.checkpoint import CheckpointConfig, Checkpointer
from meshlm.train.checkpoint import lock as _ckpt_lock

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from meshlm.train.checkpoint import lock; lock.acquire(sys.argv[1], 'runs/a'); print('held', flush=True); time.sleep(60)"


def _holder(root) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(autouse=True)
def _no_locks_left():
    yield
    _ckpt_lock.release_all()


def test_a_lock_held_by_another_process_refuses_naming_it_and_kill_9_frees_it(tmp_path):
    p = _holder(tmp_path)
    try:
        with pytest.raises(CheckpointError) as e:
            _ckpt_lock.acquire(str(tmp_path), "runs/b")
        msg = str(e.value)
        assert f"pid {p.pid} on host {socket.gethostname()} (run dir runs/a, since " in msg
        assert f"checkpoint.dir='{tmp_path}' is in use by another run" in msg and "another checkpoint.dir" in msg
        assert "\n" not in msg
        # through the Checkpointer: it refuses before it resumes, cleans or saves anything
        (tmp_path / ".tmp_step_00000004").mkdir()
        ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), resume="auto"), model=torch.nn.Linear(1, 1))
        with pytest.raises(CheckpointError, match=f"pid {p.pid}"):
            ck.resume()
        with pytest.raises(CheckpointError, match=f"pid {p.pid}"):
            ck.save(4)
        assert sorted(os.listdir(tmp_path)) == [".tmp_step_00000004", "LOCK"]
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    lock = _ckpt_lock.acquire(str(tmp_path), "runs/b")  # the kernel dropped the dead holder's flock
    assert f"from pid {p.pid} on host {socket.gethostname()} (run dir runs/a" in lock.took_over_line()
    assert "which is gone" in lock.took_over_line()
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "LOCK").read_text() == ""  # released: the next run takes over nothing
    assert _ckpt_lock.acquire(str(tmp_path)).took_over_line() is None


def test_a_lock_file_naming_a_dead_pid_is_taken_over(tmp_path):
    pid = _dead_pid()
    holder = {"host": socket.gethostname(), "pid": pid, "run_dir": "outputs/x", "since": time.time() - 60}
    (tmp_path / "LOCK").write_text(json.dumps(holder) + "\n")
    lock = _ckpt_lock.acquire(str(tmp_path), "outputs/y")
    assert f"took over {tmp_path / 'LOCK'} from pid {pid} on host" in lock.took_over_line()
    # this process holds it once more, and lets go after the last release only
    assert _ckpt_lock.acquire(str(tmp_path)) is lock
    lock.release()
    assert json.loads((tmp_path / "LOCK").read_text())["run_dir"] == "outputs/y"
    lock.release()
    assert (tmp_path / "LOCK").read_text() == ""


def test_the_checkpointer_holds_the_lock_until_close(tmp_path):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), resume="auto"), model=torch.nn.Linear(1, 1), run_dir="r1")
    assert ck.resume() is None
    assert json.loads((tmp_path / "LOCK").read_text()) == {**ck.lock.holder, "run_dir": "r1"}
    ck.save(1)
    ck.close()
    assert (tmp_path / "LOCK").read_text() == "" and not _ckpt_lock._HELD
    # a fresh run refused by the run rules (NOTE [one run per checkpoint directory]) leaves LOCK as it found it
    with pytest.raises(CheckpointError, match="starts fresh"):
        Checkpointer(CheckpointConfig(dir=str(tmp_path)), model=torch.nn.Linear(1, 1)).resume()
    assert (tmp_path / "LOCK").read_text() == "" and not _ckpt_lock._HELD


def test_without_flock_the_file_decides(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    here = socket.gethostname()
    cases = [  # (holder, refused, what the message adds)
        ({"host": here, "pid": os.getppid(), "since": 0}, True, ""),
        ({"host": "elsewhere", "pid": 1, "since": 0}, True, "if it is gone (its host crashed), delete"),
        ({"host": here, "pid": _dead_pid(), "since": 0}, False, ""),
    ]
    for holder, refused, says in cases:
        (tmp_path / "LOCK").write_text(json.dumps(holder))
        if refused:
            with pytest.raises(CheckpointError, match=f"pid {holder['pid']} on host {holder['host']}") as e:
                _ckpt_lock.acquire(str(tmp_path))
            assert says in str(e.value)
        else:
            lock = _ckpt_lock.acquire(str(tmp_path))
            assert f"pid {holder['pid']}" in lock.took_over_line()
            lock.release()
