"""``meshlm train`` end to end, as a user runs it: subprocesses with timeouts, tiny runs.

2 and 4 worker processes started by the command itself, a sweep, 2 "nodes" x 2 processes
through torchrun's c10d rendezvous, and the fault cases.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["model=llama_tiny", "train.seq_len=32", "train.batch_size=8", "train.warmup_steps=2",
        "train.val_every=0", "train.val_batches=1", "train.progress=false", "train.pg_timeout_s=60"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def meshlm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlm.app.cli", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _check_outputs(run_dir: Path, steps: int) -> list[dict]:
    for f in ("config.yaml", "metrics.jsonl", "loss.png", "summary.json", "logs/rank0.log"):
        assert (run_dir / f).exists(), f
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for k in ("loss", "lr", "tokens_per_s", "rss_bytes", "grad_norm"):
        assert all(r[k] is not None for r in rows), k
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, "loss did not fall"
    assert rows[-1].get("val_loss") is not None
    return rows


def in_process(capfd, *args: str) -> tuple[int, str]:
    """``meshlm ARGS`` through the command's entry point in this process: its exit status and
    stderr.  For bad input that stops before any worker starts (a process start costs
    seconds); the exit-status and stderr contract of each kind of failure is checked through
    a real process: ``test_bad_config_value_names_key_and_choices`` (a config error),
    ``test_crashing_worker_ends_job_with_root_cause_once`` (a worker's error),
    tests/dist/test_run_lifecycle.py (a signal)."""
    from meshlm.app.cli import main

    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # the Hydra task exits by itself
        code = e.code
    return int(code or 0), capfd.readouterr().err


DDP = [*TINY, "layout=ddp", "mesh=dp2", "train.steps=6", "train.grad_accum=2"]


@pytest.fixture(scope="module")
def dtype_runs(tmp_path_factory) -> dict:
    """The same 2-process ddp run in bfloat16 and in float16 (this one saving checkpoints):
    ``{dtype: (completed process, run dir)}``."""
    base = tmp_path_factory.mktemp("dtypes")
    runs = {}
    for dt in ("bfloat16", "float16"):
        run_dir = base / dt
        extra = [f"checkpoint.dir={base / 'ck'}", "checkpoint.every=3"] if dt == "float16" else []
        runs[dt] = (meshlm("train", *DDP, f"train.param_dtype={dt}", *extra, f"hydra.run.dir={run_dir}"), run_dir)
    return runs


def test_train_two_processes(dtype_runs):
    r, run_dir = dtype_runs["bfloat16"]
    assert r.returncode == 0, r.stderr[-3000:]
    _check_outputs(run_dir, 6)
    assert "done: 6 steps" in r.stdout
    assert (run_dir / "logs" / "rank1.log").exists()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["comm_bytes_per_step"] > 0


def test_train_pipeline_fsdp_pp(tmp_path):
    """``meshlm train layout=fsdp_pp``: 4 processes on a 2-D mesh, pp=2 stages of fsdp=2, 2
    micro-batches a step through the zero-bubble V schedule; every rank logs; the header
    gives the whole model's size (each stage holds half)."""
    r = meshlm("train", *TINY, "model.layers=4", "layout=fsdp_pp", "mesh=fsdp2_pp2", "train.grad_accum=2",
               "pipeline.schedule=zbv", "pipeline.stages_per_rank=2", "train.steps=8", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_outputs(tmp_path, 8)
    assert "llama_tiny (0.2M params), layout fsdp_pp" in r.stdout, r.stdout[:400]
    assert "done: 8 steps" in r.stdout
    assert sorted(p.name for p in (tmp_path / "logs").glob("rank*.log")) == [f"rank{i}.log" for i in range(4)]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 4 and s["layout"] == "fsdp_pp"


def test_pipeline_bad_input_stops_before_the_workers_train(tmp_path, capfd):
    """A schedule name typo is a config error naming the key (no process starts); fewer
    micro-batches than pp ranks under 1f1b stops every worker with the fix."""
    code, err = in_process(capfd, "train", *TINY, "layout=pp", "mesh=pp2", "pipeline.schedule=1f1",
                           f"hydra.run.dir={tmp_path / 'a'}")
    assert code != 0 and "pipeline.schedule='1f1' is not allowed" in err, err[-2000:]
    r = meshlm("train", *TINY, "layout=pp", "mesh=pp2", "train.steps=2", f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode != 0, r.stdout[-2000:]
    assert "train.grad_accum=1 < mesh.pp=2" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_train_user_model(tmp_path):
    """A model from a package outside meshlm (tests/usermodel/mymodels), named on the command
    line: ``model._target_`` starts from the empty node (conf/model/custom.yaml), so only the
    keys given reach it, and ``model.width`` is added to the node without Hydra's ``+``."""
    env = _env()
    env["PYTHONPATH"] = str(REPO / "tests" / "usermodel") + os.pathsep + env["PYTHONPATH"]
    args = [a for a in TINY if not a.startswith("model=")]
    r = subprocess.run([sys.executable, "-m", "meshlm.app.cli", "train", *args, "model._target_=mymodels.TinyLM",
                        "model.width=32", "layout=fsdp", "mesh=fsdp2", "train.steps=8", f"hydra.run.dir={tmp_path}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_outputs(tmp_path, 8)
    assert "meshlm train: TinyLM (" in r.stdout
    import yaml

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert saved == {"_target_": "mymodels.TinyLM", "name": None, "init_from": None, "width": 32}


def test_train_plain_model(tmp_path):
    """A plain PyTorch model (weights and buffers made in ``__init__``, no ``init_weights``:
    tests/usermodel/mymodels/plain.py) trains as it is: built whole on the host from
    ``train.seed`` (NOTE [model build] in meshlm/app/model_plain.py), which the memory line says."""
    env = _env()
    env["PYTHONPATH"] = str(REPO / "tests" / "usermodel") + os.pathsep + env["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-m", "meshlm.app.cli", "train", "model._target_=mymodels.plain.PlainLM",
                        "model.seq=16", "train.seq_len=16", "train.batch_size=8", "train.warmup_steps=1",
                        "train.val_every=0", "train.val_batches=1", "train.progress=false", "layout=fsdp_tp",
                        "mesh=fsdp2_tp2", "train.steps=8", "train.pg_timeout_s=60", f"hydra.run.dir={tmp_path}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_outputs(tmp_path, 8)
    done = r.stdout.strip().splitlines()[-1]
    assert "model built whole on the host from train.seed, then sliced (" in done, done
    assert "one copy per host while building" in done, done
    assert json.loads((tmp_path / "summary.json").read_text())["build"] == "host"


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_writes_summary(tmp_path):
    """A sweep's summary: rows labelled by the key the sweep varies only; ddp on one device
    degenerates (NOTE [effective sharding]) and says so; every run's loss curve on one
    figure."""
    seeds = [0, 1]
    r = meshlm("train", "-m", *TINY, "layout=ddp", "mesh=cpu1", "train.steps=2", "train.seed=0,1",
               f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ("summary.md", "summary.csv", "summary.png", "curves.png"):
        assert (tmp_path / f).exists(), f
    rows = _csv(tmp_path / "summary.csv")
    assert [row["run"] for row in rows] == [f"train.seed={s}" for s in seeds]
    assert all(row["layout_effective"] == "ddp (runs as: one device)" for row in rows)
    assert "its data parallel (dp/fsdp) drops out" in r.stderr
    md = (tmp_path / "summary.md").read_text()
    assert "| train.seed=0 | ddp (runs as: one device) |" in md and "Warnings:" in md
    from meshlm.app.sweep import runs
    from meshlm.app.sweep_plots import curves_figure

    fig = curves_figure(runs(tmp_path))
    for ax in fig.axes:
        assert [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")] == \
            [f"train.seed={s}" for s in seeds]


def test_sweep_memory_by_kind_and_a_failed_job(tmp_path):
    """ddp, tp and fsdp on fsdp=2 under layout.strict=true: tp degenerates there, so its job
    fails at once with the reason, and the sweep still summarises the other two, whose
    memory by kind differs as the planner says (within 10%).  Rows in job order (sorting the
    job directories by name length, as before, gave tp, ddp, fsdp)."""
    r = meshlm("train", "-m", *TINY, "layout=ddp,tp,fsdp", "mesh=fsdp2", "layout.strict=true", "train.steps=2",
               f"hydra.sweep.dir={tmp_path}", timeout=400)
    assert r.returncode == 1 and "1 of 3 runs failed" in r.stderr, r.stderr[-3000:]
    rows = {row["run"]: row for row in _csv(tmp_path / "summary.csv")}
    assert list(rows) == ["layout=ddp", "layout=tp", "layout=fsdp"]
    err = rows["layout=tp"]["error"]
    assert "LayoutError" in err and "tp has size 1" in err and "layout.strict=true" in err and "\n" not in err
    assert rows["layout=ddp"]["error"] == rows["layout=fsdp"]["error"] == ""
    ddp, fsdp = rows["layout=ddp"], rows["layout=fsdp"]
    for kind in ("params", "grads", "optimizer"):
        got = int(ddp[f"mem_{kind}_bytes"]) - int(fsdp[f"mem_{kind}_bytes"])
        want = int(ddp[f"planned_{kind}_bytes"]) - int(fsdp[f"planned_{kind}_bytes"])
        assert want > 0 and abs(got - want) <= 0.1 * want, (kind, got, want)
    assert int(fsdp["mem_peak_bytes"]) < int(ddp["mem_peak_bytes"])


def test_crashing_worker_ends_job_with_root_cause_once(tmp_path):
    t0 = time.time()
    r = meshlm("train", *TINY, "layout=ddp", "mesh=dp2", "train.steps=20", "train.inject_crash_step=2",
               "train.inject_crash_rank=1", f"hydra.run.dir={tmp_path}", timeout=120)
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert out.count("injected crash on rank 1 at step 2") == 2, out  # message + its traceback line, once
    assert "worker rank 1" in out
    assert time.time() - t0 < 110


def test_nan_loss_stops_naming_the_step(tmp_path, capfd):
    """One device: the run is this process's (``in_process``)."""
    code, err = in_process(capfd, "train", *TINY, "layout=single", "mesh=cpu1", "train.steps=5",
                           "train.inject_nan_step=3", f"hydra.run.dir={tmp_path}")
    assert code == 1
    assert "loss is nan at step 3" in err and "train.skip_nonfinite" in err, err[-3000:]


def test_nan_loss_skipped_when_configured(tmp_path, capfd):
    code, err = in_process(capfd, "train", *TINY, "layout=single", "mesh=cpu1", "train.steps=4",
                           "train.inject_nan_step=2", "train.skip_nonfinite=true", f"hydra.run.dir={tmp_path}")
    assert code == 0, err[-3000:]
    rows = _metrics(tmp_path)
    assert rows[1] == {"step": 2, "loss": None, "lr": rows[1]["lr"], "skipped": True}
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 1


def test_bad_config_value_names_key_and_choices(tmp_path):
    r = meshlm("train", "train.compile=jit", f"hydra.run.dir={tmp_path}", timeout=60)
    assert r.returncode == 1
    assert "train.compile='jit'" in r.stderr and "aot_eager" in r.stderr


def test_mesh_too_large_for_this_machine_stops_before_any_worker(tmp_path):
    """256 ranks on one machine (NOTE [local process limit] in meshlm/app/launch.py): one line
    naming the mesh, its size and the limit, status 1, no worker started (no rank's log);
    it was a 65-line traceback ending in 'too many fds' after 125 workers had started."""
    t0 = time.time()
    r = meshlm("train", *TINY, "mesh=dp4_fsdp8_tp8", "layout=fsdp_tp", "train.batch_size=256",
               f"hydra.run.dir={tmp_path}", timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "mesh dp=4,fsdp=8,tp=8 needs 256 worker processes but this machine can start at most" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "logs").exists() and time.time() - t0 < 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_mesh_mismatch_says_both_numbers(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "meshlm.app.train", *TINY, "mesh=dp4", f"hydra.run.dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "4 devices but the job has 2 processes" in r.stdout + r.stderr


def test_two_nodes_through_c10d_rendezvous(tmp_path):
    """2 torchrun agents ("nodes") x 2 processes on localhost, c10d rendezvous.

    The rendezvous store is hosted by this test (``is_host=false`` on both agents), as a
    cluster's head service would host it. Left to the agents, whichever one hosts it can
    exit while the other is still in torchrun's exit barrier on that store; the other
    then waits out the barrier's 300 s (pytorch/pytorch#69520). A CI run timed out here
    with one agent still running after the other had returned; the old test kept no
    output, so this race is the likely cause, not a proven one. Both agents' output is
    now read concurrently and shown on failure.
    """
    from torch.distributed import TCPStore

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-conf", "is_host=false,join_timeout=120", "--rdzv-id", f"meshlm-test-{port}",
               "--max-restarts", "0", "-m", "meshlm.app.train", *TINY,
               "layout=fsdp", "mesh=dp2_fsdp2", "train.steps=5", f"hydra.run.dir={tmp_path}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = ["", ""]

    def drain(i: int) -> None:
        outs[i] = procs[i].communicate()[0]

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in (0, 1)]
    for t in readers:
        t.start()
    deadline = time.time() + 240
    for t in readers:
        t.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in readers:
        t.join(10)
    del store
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], "\n\n".join(f"node {i} (rc {codes[i]}):\n{outs[i][-3000:]}" for i in (0, 1))
    rows = _metrics(tmp_path)
    assert len(rows) == 5 and json.loads((tmp_path / "summary.json").read_text())["world_size"] == 4


def test_float16_trains_with_loss_scaling_like_bfloat16(dtype_runs):
    """train.param_dtype=float16 trains under dynamic loss scaling (the scale in the metrics
    and in the checkpoint, NOTE [mixed precision] in meshlm/layout/precision.py), step by step
    close to the same run in bfloat16 (tolerance: tests/harness/tolerances.py)."""
    import torch

    from harness.tolerances import FP16_VS_BF16_LOSS_RTOL

    rows = {}
    for dt, (r, run_dir) in dtype_runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
        rows[dt] = _metrics(run_dir)
    assert [r["step"] for r in rows["float16"]] == list(range(1, 7)) and not any(r.get("skipped") for r in rows["float16"])
    assert all(r["loss_scale"] == 2.0**16 for r in rows["float16"]), rows["float16"]
    for a, b in zip(rows["bfloat16"], rows["float16"]):
        assert abs(a["loss"] - b["loss"]) <= FP16_VS_BF16_LOSS_RTOL * a["loss"], (a, b)
    saved = torch.load(dtype_runs["float16"][1].parent / "ck" / "step_00000006" / "extra.pt", weights_only=False)["extra"]
    assert saved["loss_scaler"] == {"scale": 2.0**16, "good_steps": 6}, saved
