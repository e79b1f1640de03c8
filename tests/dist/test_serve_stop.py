"""``meshlm serve`` stops within seconds on SIGTERM and SIGINT, in the middle of a long
request, on one process and tensor parallel over 2 workers, with one line naming the signal
and the exit status 128 + its number (NOTE [stopping a server] in meshlm/app/serve.py);
its workers end when its launcher is killed outright (NOTE [launcher death] in
meshlm/app/watchdog.py).  A tiny GPT-2 of 4096 positions and no end-of-sequence token, and 16
requests of 4000 tokens queued one behind another: far longer than a stop may take."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_launcher_death import gone_within, session

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[2]
STOP_S = 8  # GRACE_S (2) for the request in flight, the engine's stop, the agent's join, slack for a busy CI host


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from harness.hf_tiny import tiny_gpt2
    from harness.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("gpt2")
    train_bpe(d, vocab=300)
    m = tiny_gpt2(vocab=300, layers=4, positions=4096)
    m.config.eos_token_id = m.generation_config.eos_token_id = None  # nothing ends a request early
    m.save_pretrained(d, safe_serialization=True)
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(model_dir):
    """``serve(*args)``: a server of the tiny model and its port; every process of its session
    is killed at the end of the test, whatever failed."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, int]:
        p, port = _serve(model_dir, *args, started=started)
        return p, port

    yield start
    for p in started:
        if session(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _serve(d: Path, *args: str, started: list) -> tuple[subprocess.Popen, int]:
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, "-m", "meshlm.app.cli", "serve", str(d), "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    started.append(p)
    deadline = time.time() + 180
    while time.time() < deadline:
        assert p.poll() is None, p.communicate()[1][-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.loads(r.read())["status"] == "ok":
                    return p, port
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("meshlm serve did not come up in 180 s")


def _long_requests(port: int, n: int = 16) -> list[threading.Thread]:
    """``n`` requests of 4000 tokens each, each in a thread, queued behind one another (the
    server decodes one at a time: --max-batch 1), in flight for 3 s: on any machine the last
    ends long after a stop may take.  Not streamed: a random model's bytes seldom make whole
    UTF-8 text to stream."""
    body = json.dumps({"prompt": "the quick brown", "max_tokens": 4000, "temperature": 0}).encode()

    def post():
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
        except OSError:
            pass

    threads = [threading.Thread(target=post, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(3)
    assert sum(t.is_alive() for t in threads) > 1, "the requests ended before the server was stopped"
    return threads


def _stopped(p: subprocess.Popen) -> tuple[float, str]:
    """Seconds until every process of the server's session is gone, and its stderr."""
    t0 = time.monotonic()
    p.wait(timeout=60)
    gone, left = gone_within(p.pid, 60)
    took = time.monotonic() - t0
    assert gone, left
    return took, p.communicate()[1]


def test_one_process_stops_on_a_signal_during_a_long_request(serve):
    """SIGTERM; SIGINT takes the same handler (meshlm/app/serve.py sets both at once), and
    its exit status and line are checked with the workers' Ctrl-C below."""
    sig = signal.SIGTERM
    p, port = serve("--max-batch", "1")
    _long_requests(port)
    os.kill(p.pid, sig)
    took, err = _stopped(p)
    assert took < STOP_S, (took, err[-3000:])
    assert p.returncode == 128 + sig, err[-3000:]
    assert f"meshlm serve: stopped by {sig.name}; exit status {128 + sig}" in err
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C"])
def test_tensor_parallel_server_stops_with_its_workers(serve, how):
    p, port = serve("--layout", "tp", "--mesh", "tp=2", "--max-batch", "1")
    assert len(session(p.pid)) >= 3  # the launcher and its 2 workers
    _long_requests(port)
    sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
    if how == "Ctrl-C":
        os.killpg(p.pid, sig)  # the terminal sends it to every process of the foreground group
    else:
        os.kill(p.pid, sig)
    took, err = _stopped(p)
    assert took < STOP_S, (took, err[-3000:])
    assert p.returncode == 128 + sig, err[-3000:]
    assert f"meshlm serve: stopped by {sig.name}; exit status {128 + sig}" in err
    assert "Traceback" not in err, err[-3000:]


def test_tensor_parallel_workers_end_with_a_killed_launcher(serve):
    p, port = serve("--layout", "tp", "--mesh", "tp=2", "--max-batch", "1")
    _long_requests(port)
    os.kill(p.pid, signal.SIGKILL)
    took, err = _stopped(p)
    assert took < 10, f"workers still running {took:.1f} s after the launcher was killed"
    assert f"the launcher (pid {p.pid}) is gone; worker rank 0" in err
