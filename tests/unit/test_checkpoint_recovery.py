"""Checkpoints when something is wrong: a damaged newest checkpoint under
``checkpoint.resume=auto`` (NOTE [damaged checkpoints] in meshlm/train/checkpoint/save.py), a save that
runs out of disk (NOTE [failed save]), a ``checkpoint.dir`` that cannot hold checkpoints and
a resume path that does not exist: each one line that says what and how to go on, nothing
damaged loaded, nothing complete lost.  One process, a plain module: the rules are rank 0's
file handling (tests/dist/test_checkpoint_errors.py runs them on two ranks)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from harness.faults import full_disk
from meshlm.core.errors import CheckpointError, ConfigError
from meshlm.train.checkpoint import CheckpointConfig, Checkpointer, list_checkpoints


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


def _run(root, steps, *, resume=None, seed=0) -> Checkpointer:
    ck = Checkpointer(CheckpointConfig(dir=str(root), every=2, keep=0, resume=resume), model=_model(seed))
    ck.resume()
    for s in steps:
        ck.maybe_save(s, {"step": s})
    return ck


def _truncate(ckpt: str) -> None:
    f = os.path.join(ckpt, "__0_0.distcp")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def _steps(root) -> list[int]:
    return [s for s, _p in list_checkpoints(str(root))]


# --------------------------------------------------------------------------- damaged newest
def test_resume_auto_takes_the_newest_valid_checkpoint(tmp_path, capsys):
    _run(tmp_path, range(1, 7))  # steps 2, 4, 6
    newest = str(tmp_path / "step_00000006")
    _truncate(newest)
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), every=2, resume="auto"), model=_model(1))
    assert ck.resume()["step"] == 4
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and newest in said[0] and "truncated" in said[0], said
    assert not os.path.exists(newest) and os.path.isdir(newest + ".damaged")  # set aside, kept
    assert _steps(tmp_path) == [2, 4]
    ck.maybe_save(6, {"step": 6})  # the run goes on: step 6 is saved again, not refused
    assert _steps(tmp_path) == [2, 4, 6]


def test_resume_auto_loads_the_weights_of_the_valid_one(tmp_path):
    ck = _run(tmp_path, range(1, 5))  # steps 2, 4
    want = ck.model.weight.detach().clone()
    with torch.no_grad():
        ck.model.weight.add_(1.0)
    ck.save(5, {"step": 5})
    _truncate(str(tmp_path / "step_00000005"))
    again = _run(tmp_path, [], resume="auto", seed=7)
    assert torch.equal(again.model.weight, want)


def test_resume_auto_when_every_checkpoint_is_damaged(tmp_path):
    _run(tmp_path, range(1, 5))
    for _s, p in list_checkpoints(str(tmp_path)):
        _truncate(p)
    with pytest.raises(CheckpointError) as e:
        _run(tmp_path, [], resume="auto")
    msg = str(e.value)
    assert "every checkpoint" in msg and "step_00000002" in msg and "step_00000004" in msg and "\n" not in msg
    assert _steps(tmp_path) == [2, 4]  # nothing moved


def test_resuming_an_older_step_says_how_to_proceed(tmp_path):
    _run(tmp_path, range(1, 7))
    with pytest.raises(CheckpointError) as e:
        _run(tmp_path, [], resume=str(tmp_path / "step_00000002"))
    msg = str(e.value)
    assert "checkpoint.resume=auto" in msg and "new directory" in msg, msg
    assert "step_00000004, step_00000006" in msg and "move" in msg, msg


# --------------------------------------------------------------------------- disk full
def _assert_failed_save(msg: str, root, step: int) -> None:
    assert "\n" not in msg, msg
    assert f"checkpoint.dir={str(root)!r}" in msg and f"saving step {step}" in msg, msg
    assert "No space left on device" in msg and "free there" in msg, msg
    assert f".tmp_step_{step:08d}" in msg and "removed" in msg, msg
    assert not any(n.startswith(".tmp_step_") for n in os.listdir(root)), os.listdir(root)


def test_disk_full_while_writing_shards(tmp_path, monkeypatch):
    ck = _run(tmp_path, range(1, 5))  # steps 2, 4
    before = {p: sorted(os.listdir(p)) for _s, p in list_checkpoints(str(tmp_path))}
    with full_disk(), pytest.raises(CheckpointError) as e:
        ck.maybe_save(6, {"step": 6})
    _assert_failed_save(str(e.value), tmp_path, 6)
    assert "the checkpoint needs about" in str(e.value)
    assert {p: sorted(os.listdir(p)) for _s, p in list_checkpoints(str(tmp_path))} == before
    monkeypatch.undo()
    assert _run(tmp_path, [], resume="auto").resumed["step"] == 4  # the older ones still load


def test_disk_full_while_committing(tmp_path, monkeypatch):
    import meshlm.train.checkpoint.save as checkpoint

    ck = _run(tmp_path, range(1, 3))
    real = checkpoint._atomic_write

    def full(path, data):
        if path.endswith("meta.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + ".part")
        real(path, data)

    monkeypatch.setattr(checkpoint, "_atomic_write", full)
    with pytest.raises(CheckpointError) as e:
        ck.save(4, {"step": 4})
    _assert_failed_save(str(e.value), tmp_path, 4)
    assert _steps(tmp_path) == [2]


def _train(*overrides) -> int:
    """``meshlm train`` in this process on one device (a tiny model): its exit status."""
    from meshlm.app.cli import main

    tiny = ["mesh=cpu1", "model=llama_tiny", "layout=single", "train.batch_size=2", "train.seq_len=16"]
    try:
        return main(["train", *tiny, "train.val_every=0", *overrides])
    except SystemExit as e:  # the Hydra task exits by itself
        return int(e.code or 0)


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("meshlm train: error:")]


def test_meshlm_train_exits_with_one_line_when_the_disk_fills(tmp_path, monkeypatch, capsys):
    ckdir = tmp_path / "ck"
    monkeypatch.chdir(tmp_path)
    with full_disk():
        rc = _train("train.steps=2", f"checkpoint.dir={ckdir}", "checkpoint.every=1")
    lines = _errors(capsys.readouterr().err)
    assert rc == 1 and len(lines) == 1, lines
    _assert_failed_save(lines[0].split("error: ", 1)[1], ckdir, 1)


# --------------------------------------------------------------------------- checkpoint.dir
def test_checkpoint_dir_that_is_a_file(tmp_path):
    from meshlm.app.config import check_checkpoint_dir

    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"is a file, not a directory"):
        check_checkpoint_dir(str(f))
    with pytest.raises(ConfigError, match=rf"{f} is a file, so no directory can be made under it"):
        check_checkpoint_dir(str(f / "sub" / "ckpt"))


def test_checkpoint_dir_not_writable(tmp_path, monkeypatch):
    from meshlm.app.config import check_checkpoint_dir

    # tests run as root, whom permission bits do not stop: the answers are faked
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(ConfigError, match=r"not writable by this user"):
        check_checkpoint_dir(str(tmp_path / "ck"))
    monkeypatch.undo()

    class _ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: _ReadOnly())
    with pytest.raises(ConfigError, match=rf"{tmp_path} is on a read-only file system"):
        check_checkpoint_dir(str(tmp_path / "ck"))


def test_checkpoint_dir_that_is_fine(tmp_path):
    from meshlm.app.config import check_checkpoint_dir

    check_checkpoint_dir(str(tmp_path / "new" / "ck"))  # made at the first save
    check_checkpoint_dir(str(tmp_path))
    check_checkpoint_dir(None)


def test_meshlm_train_with_a_file_as_checkpoint_dir(tmp_path, monkeypatch, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.chdir(tmp_path)
    rc = _train("train.steps=1", f"checkpoint.dir={f}")
    assert rc == 1 and _errors(capsys.readouterr().err) == [
        f"meshlm train: error: checkpoint.dir={str(f)!r} is a file, not a directory; set checkpoint.dir to a "
        "directory (it is created if missing)"
    ]


# --------------------------------------------------------------------------- missing paths
def test_resume_path_that_does_not_exist(tmp_path):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), resume=str(tmp_path / "nope")), model=_model(0))
    with pytest.raises(CheckpointError) as e:
        ck.resume()
    msg = str(e.value)
    assert str(tmp_path / "nope") in msg and "does not exist" in msg and "killed" not in msg, msg


def test_convert_from_a_source_that_does_not_exist(tmp_path, capsys):
    from meshlm.app.cli import main

    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip()
    assert "no such file or directory" in err and "resume" not in err and len(err.splitlines()) == 1, err
