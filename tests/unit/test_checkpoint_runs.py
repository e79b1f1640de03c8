"""A checkpoint directory belongs to one run (NOTE [one run per checkpoint directory] in
meshlm/train/checkpoint/runs.py): two runs into one directory lose nothing and never mix.  One process,
a plain module: the rules are rank 0's file handling, the same on any world size."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from meshlm.core.errors import CheckpointError
from meshlm.train.checkpoint import CheckpointConfig, Checkpointer, list_checkpoints, read_meta, save_checkpoint


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


def _run(root, seed: int, steps, *, keep: int = 3, resume=None) -> Checkpointer:
    ck = Checkpointer(CheckpointConfig(dir=str(root), every=2, keep=keep, resume=resume), model=_model(seed))
    ck.resume()
    for s in steps:
        ck.maybe_save(s, {"step": s, "seed": seed})
    return ck


def _digest(root) -> dict[str, str]:
    """Every file under ``root`` (run.json aside) and the hash of its bytes."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if f != "run.json":
                out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def test_a_fresh_run_into_another_runs_directory_refuses(tmp_path):
    a = _run(tmp_path, 0, range(1, 7))
    before = _digest(tmp_path)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 4, 6]
    assert {read_meta(p)["run_id"] for _s, p in list_checkpoints(str(tmp_path))} == {a.run_id}
    assert json.load(open(tmp_path / "run.json"))["run_id"] == a.run_id
    with pytest.raises(CheckpointError) as e:
        _run(tmp_path, 1, range(1, 3))  # run B: another seed, no resume
    msg = str(e.value)
    assert str(tmp_path) in msg and a.run_id in msg and "checkpoint.resume=auto" in msg and "checkpoint.dir" in msg
    assert _digest(tmp_path) == before  # nothing of A replaced or deleted


def test_resume_auto_continues_the_same_run(tmp_path):
    a = _run(tmp_path, 0, range(1, 5))
    b = _run(tmp_path, 0, range(5, 9), resume="auto")
    assert b.run_id == a.run_id
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [4, 6, 8]


def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
    # a checkpoint of another run in the directory (here: one without a run id, as saved by
    # an earlier meshlm); this run resumes from it and keeps 1 of its own
    save_checkpoint(str(tmp_path), 2, model=_model(0), extra={"step": 2})
    ck = _run(tmp_path, 0, range(3, 9), keep=1, resume="auto")
    steps = {s: read_meta(p).get("run_id") for s, p in list_checkpoints(str(tmp_path))}
    assert steps == {2: None, 8: ck.run_id}


def test_a_checkpoint_is_never_overwritten(tmp_path):
    save_checkpoint(str(tmp_path), 2, model=_model(0), extra={"step": 2}, run_id="r1")
    before = _digest(tmp_path)
    with pytest.raises(CheckpointError, match="never overwritten"):
        save_checkpoint(str(tmp_path), 2, model=_model(1), extra={"step": 2}, run_id="r1")
    assert _digest(tmp_path) == before


def test_resuming_an_older_step_refuses_to_replace_newer_ones(tmp_path):
    _run(tmp_path, 0, range(1, 7))
    older = os.path.join(str(tmp_path), "step_00000002")
    with pytest.raises(CheckpointError, match=r"later checkpoints of the same run \(steps 4, 6\)"):
        _run(tmp_path, 0, [], resume=older)


def test_resuming_into_a_directory_of_another_run_refuses(tmp_path):
    a = _run(tmp_path / "a", 0, range(1, 3))
    b = _run(tmp_path / "b", 1, range(1, 3))
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "b"), every=2, resume=str(tmp_path / "a")), model=_model(0))
    with pytest.raises(CheckpointError, match=f"belongs to run {b.run_id}.*of run {a.run_id}"):
        ck.resume()
