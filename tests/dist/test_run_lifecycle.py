"""A run as a scheduler and a user drive it, through the real ``meshlm train`` on 2 gloo
processes: SIGTERM mid-run saves and the resume continues the uninterrupted loss curve
exactly, as does a resume after SIGKILL of the whole job; a resume at the last step exits
0; a second fresh run into the same checkpoint directory refuses and changes nothing; a
converted Hugging Face checkpoint resumes from its directory alone (meshlm/train/lifecycle.py, meshlm/train/checkpoint/runs.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
RUN = ["model=llama_tiny", "layout=fsdp", "mesh=fsdp2", "train.seq_len=32", "train.batch_size=8",
       "train.warmup_steps=2", "train.val_every=0", "train.val_batches=1", "train.progress=false",
       "train.pg_timeout_s=60", f"train.steps={STEPS}", "checkpoint.every=0"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    keys = {o.split("=", 1)[0] for o in overrides}
    run = [a for a in RUN if a.split("=", 1)[0] not in keys]
    return subprocess.Popen([sys.executable, "-m", "meshlm.app.cli", "train", *run, *overrides,
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    return p.returncode, out, err


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """An uninterrupted run; the same run sent SIGTERM (the launcher only, as Kubernetes
    does) after step 3; its resume with checkpoint.resume=auto."""
    d = tmp_path_factory.mktemp("preempt")
    rc, out, err = _finish(_start(d / "ref"))
    assert rc == 0, err[-3000:]
    ref = _losses(d / "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))

    ck = d / "ck"
    p = _start(d / "run1", f"checkpoint.dir={ck}")
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline:
        m = d / "run1" / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be interrupted"
    os.kill(p.pid, signal.SIGTERM)
    t_kill = time.monotonic()
    stopped = _finish(p)
    stop_s = time.monotonic() - t_kill
    listing = sorted(os.listdir(ck))
    resumed = _finish(_start(d / "run2", f"checkpoint.dir={ck}", "checkpoint.resume=auto"))
    return {"dir": d, "ck": ck, "ref": ref, "stopped": stopped, "listing": listing,
            "resumed": resumed, "stop_s": stop_s}


def test_sigterm_saves_and_exits_143_without_a_traceback(preempted):
    rc, out, err = preempted["stopped"]
    assert rc == 143, (out[-2000:], err[-3000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    got = _losses(preempted["dir"] / "run1")
    last = max(got)
    assert 3 <= last < STEPS and sorted(got) == list(range(1, last + 1))
    assert preempted["listing"] == ["LOCK", "run.json", f"step_{last:08d}"]
    assert (preempted["ck"] / "LOCK").read_text() == ""  # released (NOTE [one writer per checkpoint directory])
    [line] = [ln for ln in out.splitlines() if "stopped by SIGTERM" in ln]
    assert f"global steps 1-{last} of {STEPS}" in line and f"step_{last:08d}" in line and "exit status 143" in line
    assert f"saved step {last} (stopping on SIGTERM)" in out
    # the job is gone well within a scheduler's grace period before SIGKILL (Kubernetes: 30 s);
    # the workers do not wait for the shutting-down agent to read their return values
    assert preempted["stop_s"] < 15, preempted["stop_s"]


def test_ctrl_c_then_sigterm_waits_for_the_save_and_says_what_happened(tmp_path):
    """SIGINT to the launcher, then SIGTERM while the workers save: the launcher waits for
    them (it passes the repeat on; a worker reads one within 3 s as the same request), and
    its exit status and the one line printed name the signal the run stopped on (here the
    second signal used to cut the launcher's wait short: it exited 143 saying "before the
    first step; nothing saved" while rank 0 went on to save and print SIGINT and 130)."""
    ck = tmp_path / "ck"
    p = _start(tmp_path / "run", f"checkpoint.dir={ck}", "train.steps=100000")
    deadline = time.time() + 240
    m = tmp_path / "run" / "metrics.jsonl"
    while p.poll() is None and time.time() < deadline and not (m.exists() and len(m.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be interrupted"
    os.kill(p.pid, signal.SIGINT)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGTERM)
    rc, out, err = _finish(p, timeout=120)
    last = max(_losses(tmp_path / "run"))
    assert rc == 130, (out[-2000:], err[-3000:])
    lines = [ln for ln in (out + err).splitlines() if "stopped by" in ln]
    assert len(lines) == 1, (out[-2000:], err[-3000:])
    line = lines[0]
    assert "stopped by SIGINT after" in line and f"step_{last:08d}" in line and "exit status 130" in line, line
    assert "nothing saved" not in err and "Traceback" not in err, err[-3000:]
    assert sorted(os.listdir(ck)) == ["LOCK", "run.json", f"step_{last:08d}"]


def test_resume_after_sigterm_equals_the_uninterrupted_curve(preempted):
    rc, out, err = preempted["resumed"]
    assert rc == 0, err[-3000:]
    before = _losses(preempted["dir"] / "run1")
    after = _losses(preempted["dir"] / "run2")
    last = max(before)
    assert sorted(after) == list(range(last + 1, STEPS + 1))
    for step, loss in {**before, **after}.items():
        assert loss == preempted["ref"][step], f"step {step}: {loss} != uninterrupted {preempted['ref'][step]}"
    assert f"resumed from step {last} ({preempted['ck']}/step_{last:08d}" in out
    assert "saved under layout fsdp, mesh fsdp=2 (2 ranks); now layout fsdp, mesh fsdp=2 (2 ranks)" in out
    assert f"done: {STEPS - last} steps (this process; global steps {last + 1}-{STEPS} of {STEPS})" in out
    rows = [json.loads(x) for x in (preempted["dir"] / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["steps_run"] for r in rows] == list(range(1, STEPS - last + 1))
    s = json.loads((preempted["dir"] / "run2" / "summary.json").read_text())
    assert (s["start_step"], s["steps_run"], s["global_step"]) == (last, STEPS - last, STEPS)


def test_sigkill_of_the_whole_job_resumes_exactly(preempted, tmp_path):
    """SIGKILL to every process of the job after its step-4 checkpoint (nothing saved on the
    way out, the lock left behind); checkpoint.resume=auto continues from the newest
    complete checkpoint with the uninterrupted run's losses, bit for bit (saving does not
    change them: the reference saves nothing)."""
    ck = tmp_path / "ck"
    p = _start(tmp_path / "run1", f"checkpoint.dir={ck}", "checkpoint.every=2")
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and not (ck / "step_00000004").is_dir():
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
    rc, out, err = _finish(_start(tmp_path / "run2", f"checkpoint.dir={ck}", "checkpoint.every=2",
                                  "checkpoint.resume=auto"))
    assert rc == 0, err[-3000:]
    resumed = _losses(tmp_path / "run2")
    assert resumed and min(resumed) >= 5 and max(resumed) == STEPS, sorted(resumed)
    for step, loss in resumed.items():
        assert loss == preempted["ref"][step], f"step {step}: {loss} != uninterrupted {preempted['ref'][step]}"


def _here(capfd, run_dir: Path, *overrides: str, drop: tuple = ()) -> tuple[int, str, str]:
    """``_start``'s run on one device (layout=single, mesh=cpu1) in this process: its exit
    status, stdout and stderr (a process start saved; the real processes, their signals and
    exit statuses are the tests above); ``drop``: keys of ``RUN`` left out."""
    from meshlm.app.cli import main

    keys = {o.split("=", 1)[0] for o in overrides} | {"layout", "mesh", *drop}
    run = [a for a in RUN if a.split("=", 1)[0] not in keys]
    capfd.readouterr()
    try:
        code = main(["train", *run, "layout=single", "mesh=cpu1", *overrides, f"hydra.run.dir={run_dir}"])
    except SystemExit as e:  # the Hydra task exits by itself
        code = e.code
    out, err = capfd.readouterr()
    return int(code or 0), out, err


def test_resume_at_the_last_step_exits_0(preempted, tmp_path, capfd):
    """In this process, on one device: the fsdp=2 checkpoint at the last step, resharded."""
    rc, out, err = _here(capfd, tmp_path, f"checkpoint.dir={preempted['ck']}", "checkpoint.resume=auto")
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    assert f"nothing to do: the checkpoint resumed is at step {STEPS}" in out and "raise train.steps" in out


def test_a_second_fresh_run_into_the_directory_refuses(preempted, tmp_path):
    before = _digest(preempted["ck"])
    rc, out, err = _finish(_start(tmp_path, f"checkpoint.dir={preempted['ck']}", "train.seed=1"))
    assert rc == 1
    assert "CheckpointError" in err and f"checkpoint.dir='{preempted['ck']}'" in err
    assert "checkpoint.resume=auto" in err and "another checkpoint.dir" in err
    assert _digest(preempted["ck"]) == before


def test_resume_from_a_converted_hugging_face_checkpoint(tmp_path, capfd):
    """``meshlm convert <hf> <ck>`` then ``checkpoint.resume=auto`` with the default model:
    the model config comes with the checkpoint, and training continues from the Hugging
    Face weights exactly as ``model.init_from`` starts from them."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, head_dim=8, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(tmp_path / "hf", safe_serialization=True)
    from meshlm.app.cli import main

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0  # in this process: no worker to start
    rc, out, err = _here(capfd, tmp_path / "resumed", "train.steps=3", f"checkpoint.dir={tmp_path / 'ck'}",
                         "checkpoint.resume=auto", drop=("model",))  # the default model, as a user runs it
    assert rc == 0, err[-3000:]
    assert "model config from the checkpoint resumed" in out and "embed=32" in out
    assert "resumed from step 0" in out
    rc, out, err = _here(capfd, tmp_path / "init", "train.steps=3", f"model.init_from={tmp_path / 'hf'}",
                         drop=("model",))
    assert rc == 0, err[-3000:]
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "init")
    run_id = json.loads((tmp_path / "ck" / "run.json").read_text())["run_id"]
    metas = [json.loads((tmp_path / "ck" / d / "meta.json").read_text()) for d in ("step_00000000",)]
    assert [m["run_id"] for m in metas] == [run_id]
