"""``meshlm train`` with offload, as a user runs it (subprocesses, 2 processes on fsdp=2):

- a layout file's ``offload`` section (optimizer state, gradients, block parameters and
  saved activations on disk) gives
  the same loss and gradient-norm curve as the same run without offload, bit for bit, and
  leaves no swap file behind; the metrics say what moved;
- a run that crashes mid-run (``train.inject_crash_step``) removes its swap files, and
  resumes from its checkpoint with or without offload, with the losses of the run that
  never stopped;
- a bad ``offload.dir`` or an unsupported kind stops before any training step, naming the
  key, with a non-zero exit.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from test_train_cli import TINY, _metrics, in_process, meshlm

from harness.tolerances import INVARIANCE_RTOL

# one AdamW implementation for every run, so that runs with and without offload compare bit for bit
RUN = [*TINY, "mesh=fsdp2", "train.steps=4", "train.seed=1", "train.optimizer_impl=fused"]


def _curve(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(run_dir)]


def _swap_files(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()) if base.exists() else []


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """The run without offload that the others are held to (layout=fsdp, saving at step 2:
    saving does not change the losses)."""
    d = tmp_path_factory.mktemp("ref")
    r = meshlm("train", *RUN, "layout=fsdp", "checkpoint.every=2", f"checkpoint.dir={d / 'ck'}", f"hydra.run.dir={d}")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_a_layouts_offload_section_trains_like_no_offload(tmp_path, ref):
    lay = tmp_path / "fsdp_disk.yaml"
    lay.write_text(
        "params:\n  embed: [dp, fsdp]\ncompute:\n  batch: [dp, fsdp]\n"
        "offload:\n  optimizer: disk\n  activations: disk\n  params: disk\n  grads: disk\n"
    )
    off = meshlm("train", *RUN, f"layout.name={lay}", f"hydra.run.dir={tmp_path / 'off'}")
    assert off.returncode == 0, off.stderr[-3000:]
    assert _curve(tmp_path / "off") == _curve(ref)  # the same arithmetic, bit for bit
    rows = _metrics(tmp_path / "off")
    # from the second step on, the whole optimizer state comes in and goes out once a step
    per_step = [b["offload_optimizer_in_bytes"] - a["offload_optimizer_in_bytes"] for a, b in zip(rows, rows[1:])]
    assert len(set(per_step)) == 1 and per_step[0] > 0
    assert all(r["offload_activations_bytes"] > 0 for r in rows)
    assert all(r["offload_params_in_bytes"] > 0 and r["offload_params_prefetched_blocks"] > 0 for r in rows)
    assert all(r["offload_grads_out_bytes"] > 0 and r["offload_grads_in_bytes"] > 0 for r in rows)
    assert rows[-1]["offload_disk_bytes"] > per_step[0]  # optimizer state and block parameters
    assert _swap_files(tmp_path / "off" / "offload") == []  # removed at the end of the run
    assert (
        "offload: optimizer=disk,grads=disk,params=disk,activations=disk" in (tmp_path / "off" / "logs" / "rank0.log").read_text()
    )


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict:
    """The run of ``ref`` with its optimizer state on disk (its own swap directory), crashed
    by rank 1 at step 3 after saving step 2: its result, swap directory and checkpoints."""
    d = tmp_path_factory.mktemp("crashed")
    swap = d / "swap"
    swap.mkdir()
    r = meshlm("train", *RUN, "checkpoint.every=2", "layout=fsdp", "offload.optimizer=disk", f"offload.dir={swap}",
               f"checkpoint.dir={d / 'ck'}", "train.inject_crash_step=3", "train.inject_crash_rank=1",
               f"hydra.run.dir={d / 'crashed'}")
    return {"result": r, "swap": swap, "ck": d / "ck"}


def test_a_crashed_offloaded_run_cleans_up_and_resumes_with_or_without_offload(tmp_path, ref, crashed):
    ck = ["checkpoint.every=2", "layout=fsdp"]
    want = {r["step"]: r["loss"] for r in _metrics(ref)}
    swap, crash = crashed["swap"], crashed["result"]
    assert crash.returncode != 0 and "injected crash on rank 1 at step 3" in crash.stderr, crash.stderr[-3000:]
    assert _swap_files(swap) == [], "the crashed run left swap files"
    for resume_offload, name in ((["offload.optimizer=disk", f"offload.dir={swap}"], "with"), ([], "without")):
        ckdir = tmp_path / f"ck_{name}"  # each resume from its own copy of the crashed run's checkpoints
        shutil.copytree(crashed["ck"], ckdir)
        res = meshlm(
            "train",
            *RUN,
            *ck,
            *resume_offload,
            f"checkpoint.dir={ckdir}",
            "checkpoint.resume=auto",
            f"hydra.run.dir={tmp_path / (name + '_resumed')}",
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "resumed from step 2" in res.stdout
        got = {r["step"]: r["loss"] for r in _metrics(tmp_path / (name + "_resumed"))}
        assert got == {3: want[3], 4: want[4]}, name  # the state came back from disk exactly
        assert _swap_files(swap) == []


def test_an_offloaded_checkpoint_resumes_under_another_layout(tmp_path, ref, crashed):
    """The crashed run's step 2 (fsdp, its optimizer state saved from disk) resumed under
    zero2 on dp=2 with its optimizer on disk: steps 3 and 4 of the same schedule as the
    uninterrupted fsdp run, to the layout-invariance tolerance."""
    ckdir = tmp_path / "ck"
    shutil.copytree(crashed["ck"], ckdir)
    res = meshlm("train", *RUN, "layout=zero2", "mesh=dp2", "offload.optimizer=disk",
                 f"checkpoint.resume={ckdir / 'step_00000002'}", f"hydra.run.dir={tmp_path / 'b'}")
    assert res.returncode == 0, res.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in _metrics(ref)}
    got = {r["step"]: r["loss"] for r in _metrics(tmp_path / "b")}
    assert sorted(got) == [3, 4]
    for s in got:  # another layout reduces in another order: the invariance tolerance
        assert math.isclose(got[s], want[s], rel_tol=INVARIANCE_RTOL), (s, got[s], want[s])


def test_offloaded_gradients_inside_pipeline_stages(tmp_path):
    """fsdp_pp on fsdp=2 x pp=2, 1F1B over 2 micro-batches: each stage's unreduced gradients
    accumulate on disk and are reduced once, at the step (NOTE [pipelined step]); the same
    loss and gradient-norm curve as without, bit for bit, and no swap file left.
    ``offload.params`` is refused there, naming the key and what to offload instead."""
    pp = [*RUN, "layout=fsdp_pp", "mesh=fsdp2_pp2", "train.grad_accum=2", "train.steps=3"]
    ref = meshlm("train", *pp, f"hydra.run.dir={tmp_path / 'ref'}")
    assert ref.returncode == 0, ref.stderr[-3000:]
    off = meshlm("train", *pp, "offload.grads=disk", f"hydra.run.dir={tmp_path / 'off'}")
    assert off.returncode == 0, off.stderr[-3000:]
    assert _curve(tmp_path / "off") == _curve(tmp_path / "ref")
    rows = _metrics(tmp_path / "off")
    assert all(r["offload_grads_out_bytes"] > 0 and r["offload_grads_in_bytes"] > 0 for r in rows)
    assert _swap_files(tmp_path / "off" / "offload") == []
    bad = meshlm("train", *pp, "offload.params=disk", f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode != 0 and "offload.params=disk with the pipeline layout fsdp_pp" in bad.stderr
    assert "offload.grads" in bad.stderr and "Traceback" not in bad.stderr


def test_bad_offload_input_stops_before_any_step(tmp_path, capfd):
    missing = tmp_path / "no" / "such"
    r = meshlm(
        "train",
        *RUN,
        "layout=fsdp",
        "offload.optimizer=disk",
        f"offload.dir={missing}",
        f"hydra.run.dir={tmp_path / 'a'}",
    )
    assert r.returncode != 0
    assert f"offload.dir={str(missing)!r} does not exist; create it" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "a" / "metrics.jsonl").exists() or _metrics(tmp_path / "a") == []
    assert not missing.exists()
    code, err = in_process(capfd, "train", *RUN, "layout=fsdp", "offload.grads=bogus", f"hydra.run.dir={tmp_path / 'b'}")
    assert code != 0 and "offload.grads='bogus' is not a tier; choose one of: device, host, disk" in err
    assert not (tmp_path / "b" / "logs").exists()  # refused by the launcher, before any worker started
    summary = tmp_path / "a" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text()).get("steps_run", 0) == 0
