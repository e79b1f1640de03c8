"""Experiment tracking (NOTE [experiment tracking] in meshlm/app/tracking.py), with no network:
``meshlm.app.train.run`` on 2 gloo processes with TensorBoard, W&B (offline) and MLflow (a
local store) at once, stopped at step 3 and resumed to step 5 from its checkpoint.  Each
tracker is read back with its own reader (tensorboard's EventAccumulator, the W&B offline
run files, MlflowClient): one run, the steps 1-5 once each with the losses of
metrics.jsonl, the config, the effective layout and both ranks' memory.  A sweep through the
command groups its runs."""

from __future__ import annotations

import glob
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from meshlm.app.config import RunConfig, load_config
from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=120)
TINY = ["model=llama_tiny", "train.seq_len=32", "train.batch_size=8", "train.val_every=2", "train.val_batches=1",
        "train.progress=false", "train.count_comm=false", "train.warmup_steps=1", "layout=fsdp", "mesh=fsdp2",
        "logger=[tensorboard,wandb,mlflow]", "logger.wandb_mode=offline"]  # fmt: skip


def _run(cfg: RunConfig, run_dir: str) -> list[dict]:
    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _cfg(ck: Path, steps: int, resume: bool) -> RunConfig:
    extra = ["checkpoint.resume=auto"] if resume else []
    return load_config([*TINY, f"train.steps={steps}", f"checkpoint.dir={ck}", "checkpoint.every=3", *extra])


def _wandb_records(path: str) -> list:
    """The records of a W&B offline run file (``run-<id>.wandb``): a 7-byte header, then
    LevelDB-log records (32 KiB blocks, each record a 7-byte header and a Record protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


@pytest.fixture(scope="module")
def tracked(pool2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    ck = tmp / "ck"
    first = pool2.run(_run, _cfg(ck, 3, False), str(tmp / "a"))[0]
    second = pool2.run(_run, _cfg(ck, 5, True), str(tmp / "b"))[0]
    return ck, {r["step"]: r for r in first + second}


def test_tensorboard_events_read_back(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ck, rows = tracked
    (logdir,) = glob.glob(str(ck / "tensorboard" / "*"))  # one run, continued
    ea = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    loss = [(e.step, e.value) for e in ea.Scalars("loss")]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    assert all(v == pytest.approx(rows[s]["loss"], rel=1e-6) for s, v in loss)
    assert [e.step for e in ea.Scalars("val_loss")] == [2, 3, 4, 5]  # and at the end of each run
    assert [e.step for e in ea.Scalars("lr")] == [1, 2, 3, 4, 5]
    tags = ea.Tags()
    for r in (0, 1):
        assert f"memory/rank{r}/peak_bytes" in tags["scalars"], tags["scalars"]
    text = [t for t in tags["tensors"]]
    assert any("config" in t for t in text) and any("layout_effective" in t for t in text), text
    cfg_text = ea.Tensors([t for t in text if "config" in t][0])[0].tensor_proto.string_val[0].decode()
    assert "_target_: torch.optim.AdamW" in cfg_text and "layout:" in cfg_text


def test_wandb_offline_run_read_back(tracked):
    ck, rows = tracked
    files = sorted(glob.glob(str(ck / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2, files  # one file per session, the same run id
    assert len({Path(f).name for f in files}) == 1
    steps, config = [], {}
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "loss" in items:
                    steps.append(items["_step"])
                    assert items["loss"] == pytest.approx(rows[items["_step"]]["loss"], rel=1e-6)
            elif kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    assert steps == [1, 2, 3, 4, 5]
    assert config["layout_effective"].startswith("fsdp") and config["optim"]["_target_"] == "torch.optim.AdamW"


def test_mlflow_local_store_read_back(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store (NOTE [experiment tracking])

    ck, rows = tracked
    client = MlflowClient(tracking_uri=(ck / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("meshlm")
    (run,) = client.search_runs([exp.experiment_id])
    hist = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5]
    assert all(m.value == pytest.approx(rows[m.step]["loss"], rel=1e-6) for m in hist)
    assert run.data.params["train.steps"] == "3" and run.data.tags["layout_effective"].startswith("fsdp")
    assert "memory/rank1/optimizer_bytes" in run.data.metrics


def test_sweep_runs_are_grouped(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    cmd = [sys.executable, "-m", "meshlm.app.cli", "train", "-m", "model=llama_tiny", "train.seq_len=32",
           "train.batch_size=8", "train.steps=2", "train.val_every=0", "train.val_batches=1", "train.progress=false",
           "mesh=cpu1", "layout=single", "train.lr=1e-3,2e-3", "logger=mlflow", f"logger.dir={tmp_path / 'track'}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    client = MlflowClient(tracking_uri=(tmp_path / "track" / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("meshlm").experiment_id])
    assert len(runs) == 2 and {r.data.tags["meshlm.group"] for r in runs} == {str(tmp_path / "sweep")}
