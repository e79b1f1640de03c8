"""Reading a checkpoint runs no code from it (NOTE [trusted checkpoint files] in
meshlm/train/checkpoint/load.py): a ``.metadata`` whose pickle calls ``os.system``, with meta.json
rewritten to match, is refused by name through every load path (load_checkpoint, a resume,
``checkpoint.resume=auto``, ``meshlm convert`` and ``meshlm generate``) and its payload never
runs.  One process: the reading is the same on every rank."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib

import pytest
import torch

from meshlm.core.errors import CheckpointError
from meshlm.train.checkpoint import CheckpointConfig, Checkpointer, load_checkpoint, save_checkpoint


class _Payload:
    """Unpickling this runs ``os.system`` (what a tampered checkpoint would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite(ckpt: str, name: str, data: bytes) -> None:
    """Replace file ``name`` of ``ckpt`` with ``data`` and record it in meta.json, so the
    size and CRC-32 checks pass (they catch damage, not tampering)."""
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    meta["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)


def _tampered(good: str, where: str, marker: str) -> str:
    bad = os.path.join(where, "step_00000009")
    shutil.copytree(good, bad)
    _rewrite(bad, ".metadata", pickle.dumps(_Payload(marker)))
    return bad


@pytest.fixture
def linear_ckpt(tmp_path):
    torch.manual_seed(0)
    return save_checkpoint(str(tmp_path / "good"), 1, model=torch.nn.Linear(4, 4), extra={"step": 1})


def test_tampered_metadata_is_refused_by_load_checkpoint(tmp_path, linear_ckpt):
    marker = tmp_path / "PAYLOAD_RAN"
    bad = _tampered(linear_ckpt, str(tmp_path / "bad"), str(marker))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad, model=torch.nn.Linear(4, 4))
    assert not marker.exists(), "the checkpoint's pickle ran code"
    msg = str(e.value)
    assert os.path.join(bad, ".metadata") in msg and "posix.system" in msg and "\n" not in msg, msg


def test_tampered_metadata_is_refused_by_a_resume(tmp_path, linear_ckpt):
    marker = tmp_path / "PAYLOAD_RAN"
    bad = _tampered(linear_ckpt, str(tmp_path / "bad"), str(marker))
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "new"), resume=bad), model=torch.nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"\.metadata refused"):
        ck.resume()
    assert not marker.exists()


def test_resume_auto_skips_a_tampered_newest_checkpoint(tmp_path, linear_ckpt, capsys):
    marker = tmp_path / "PAYLOAD_RAN"
    root = str(tmp_path / "good")
    _tampered(linear_ckpt, root, str(marker))  # step 9, newer than step 1
    ck = Checkpointer(CheckpointConfig(dir=root, resume="auto"), model=torch.nn.Linear(4, 4))
    try:
        assert ck.resume()["step"] == 1
    finally:
        assert not marker.exists(), "the checkpoint's pickle ran code"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "step_00000009" in said[0] and ".metadata refused" in said[0], said


def test_only_what_a_dcp_metadata_holds_unpickles(tmp_path, linear_ckpt):
    from meshlm._torch_compat.dcp_metadata import UnsafeMetadata, read_metadata

    md = read_metadata(os.path.join(linear_ckpt, ".metadata"))  # a real one: every class it names admitted
    assert md.state_dict_metadata["model/weight"].size == torch.Size([4, 4])
    assert md.state_dict_metadata["model/weight"].properties.dtype == torch.float32
    f = str(tmp_path / "m")
    for obj in (torch.load, eval, shutil.rmtree, {"x": torch.float32}, torch.zeros(2)):
        with open(f, "wb") as fh:
            pickle.dump(obj, fh)
        with pytest.raises(UnsafeMetadata):
            read_metadata(f)


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path, linear_ckpt):
    from meshlm._torch_compat.dcp_metadata import read_metadata

    md = read_metadata(os.path.join(linear_ckpt, ".metadata"))
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"
    bad = str(tmp_path / "bad")
    shutil.copytree(linear_ckpt, bad)
    _rewrite(bad, ".metadata", pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"outside the checkpoint directory"):
        load_checkpoint(bad, model=torch.nn.Linear(4, 4))


@pytest.fixture
def llama_ckpt(tmp_path):
    import meshlm
    from meshlm.models import Llama, llama_config

    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "single", meshlm.make_mesh("dp=1"), seed=0)
    return save_checkpoint(str(tmp_path / "run"), 1, model=model, extra={"step": 1})


@pytest.mark.parametrize("command", ["convert", "generate"])
def test_cli_refuses_a_tampered_checkpoint(tmp_path, llama_ckpt, capsys, command):
    from meshlm.app.cli import main

    marker = tmp_path / "PAYLOAD_RAN"
    bad = _tampered(llama_ckpt, str(tmp_path / "bad"), str(marker))
    args = [bad, str(tmp_path / "out")] if command == "convert" else [bad, "--prompt", "a", "--max-new-tokens", "1"]
    assert main([command, *args]) != 0
    assert not marker.exists()
    err = capsys.readouterr().err.strip()
    assert os.path.join(bad, ".metadata") in err and len(err.splitlines()) == 1, err
