"""Bad checkpoints give a CheckpointError naming the file and the mismatch, on every rank,
never garbage or a hang."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=30)


def _model(**overrides):
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh("fsdp=2")
    model = meshlm.shard(Llama(llama_config("llama_tiny", **overrides), device="meta"), "fsdp", mesh, seed=0)
    return model, ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)


def _save(root):
    from meshlm.train.checkpoint import save_checkpoint

    model, opt = _model()
    x = torch.randint(0, 256, (2, 8))
    model(x, x).backward()
    opt.step()
    return save_checkpoint(root, 1, model=model, optimizer=opt, extra={"step": 1})


def _try_load(path, **overrides):
    import torch.distributed as dist

    from meshlm.train.checkpoint import load_checkpoint
    from meshlm.core.errors import CheckpointError

    model, opt = _model(**overrides)
    try:
        load_checkpoint(path, model=model, optimizer=opt)
    except CheckpointError as e:
        dist.barrier()  # every rank got here: nobody hangs in a collective
        return str(e)
    return None


def _damaged(good: str, where: str, how) -> str:
    bad = f"{where}/{how.__name__}"
    shutil.copytree(good, bad)
    how(bad)
    return bad


def truncate(d):
    f = f"{d}/__1_0.distcp"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def flip_bytes(d):
    f = f"{d}/__0_0.distcp"
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(8)
        fh.seek(-8, 1)
        fh.write(bytes(x ^ 0xFF for x in b))


def missing_shard(d):
    os.remove(f"{d}/__1_0.distcp")


def uncommitted(d):
    os.remove(f"{d}/COMMIT")


def garbage_metadata(d):
    with open(f"{d}/.metadata", "wb") as fh:
        fh.write(b"not a pickle")
    os.remove(f"{d}/meta.json")
    open(f"{d}/meta.json", "w").write("{}")  # no file list: the DCP metadata itself is read


@pytest.mark.parametrize("how,expect", [
    (truncate, ["__1_0.distcp", "truncated"]),
    (flip_bytes, ["__0_0.distcp", "CRC-32"]),
    (missing_shard, ["__1_0.distcp", "missing"]),
    (uncommitted, ["COMMIT", "did not finish"]),
    (garbage_metadata, [".metadata", "unreadable"]),
])
def test_damaged_checkpoint(pool2, tmp_path, how, expect):
    good = pool2.run(_save, str(tmp_path / "good"))[0]
    bad = _damaged(good, str(tmp_path), how)
    msgs = pool2.run(_try_load, bad)
    assert msgs[0] is not None and msgs[0] == msgs[1], msgs
    for word in expect:
        assert word in msgs[0], msgs[0]


def test_other_model_shape(pool2, tmp_path):
    good = pool2.run(_save, str(tmp_path / "good"))[0]
    msgs = pool2.run(_try_load, good, mlp=64)
    assert msgs[0] == msgs[1] and msgs[0] is not None
    assert "layers.0.mlp.w_gate" in msgs[0] and "(128, 64)" in msgs[0] and "(64, 64)" in msgs[0], msgs[0]
    assert "different model shape" in msgs[0]
    msgs = pool2.run(_try_load, good, layers=3)
    assert "layers.2." in msgs[0] and "different model" in msgs[0], msgs[0]


def test_good_checkpoint_and_auto(pool2, tmp_path):
    from meshlm.train.checkpoint import latest_checkpoint

    good = pool2.run(_save, str(tmp_path / "run"))[0]
    assert pool2.run(_try_load, good) == [None, None]
    assert pool2.run(_try_load, str(tmp_path / "run")) == [None, None]  # a run dir: its latest
    os.makedirs(tmp_path / "run" / ".tmp_step_00000009")
    os.makedirs(tmp_path / "run" / "step_00000010")  # no COMMIT: ignored
    assert latest_checkpoint(str(tmp_path / "run")) == good


# --------------------------------------------------------------------------- issue 47: trust and recovery
class _Payload:
    """Unpickling this runs a shell command (what a tampered .metadata would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tampered_metadata_is_refused_on_every_rank(pool2, tmp_path):
    import json
    import pickle
    import zlib

    good = pool2.run(_save, str(tmp_path / "good"))[0]
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    data = pickle.dumps(_Payload(str(tmp_path / "PAYLOAD_RAN")))
    with open(f"{bad}/.metadata", "wb") as fh:
        fh.write(data)
    meta = json.load(open(f"{bad}/meta.json"))
    meta["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}  # the CRC check passes
    json.dump(meta, open(f"{bad}/meta.json", "w"))
    msgs = pool2.run(_try_load, bad)
    assert not (tmp_path / "PAYLOAD_RAN").exists()
    assert msgs[0] == msgs[1] and f"{bad}/.metadata refused" in msgs[0], msgs


def _save_steps(root, steps):
    from meshlm.train.checkpoint import save_checkpoint

    model, opt = _model()
    x = torch.randint(0, 256, (2, 8))
    for s in steps:
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(root, s, model=model, optimizer=opt, extra={"step": s})


def _resume_auto(root):
    from meshlm.train.checkpoint import CheckpointConfig, Checkpointer

    model, opt = _model()
    said = []
    ck = Checkpointer(CheckpointConfig(dir=root, resume="auto"), model=model, optimizer=opt, say=said.append)
    return ck.resume()["step"], said, [p for p, _why, _to in ck.skipped]


def test_resume_auto_skips_a_damaged_newest_on_every_rank(pool2, tmp_path):
    root = str(tmp_path / "run")
    pool2.run(_save_steps, root, [1, 2])
    truncate(f"{root}/step_00000002")  # rank 1's shard
    (s0, said0, skipped0), (s1, said1, skipped1) = pool2.run(_resume_auto, root)
    assert s0 == s1 == 1
    assert skipped0 == skipped1 == [f"{root}/step_00000002"]
    assert len(said0) == 1 and "__1_0.distcp" in said0[0] and "truncated" in said0[0] and said1 == [], (said0, said1)
    assert os.path.isdir(f"{root}/step_00000002.damaged")


def _save_with_full_disk_on(root, failing_rank):
    import contextlib

    import torch.distributed as dist

    from meshlm.core.errors import CheckpointError
    from harness.faults import full_disk

    _save_steps(root, [1])
    try:
        with full_disk() if dist.get_rank() == failing_rank else contextlib.nullcontext():
            _save_steps(root, [2])
    except CheckpointError as e:
        dist.barrier()  # every rank got here: nobody hangs in a collective
        return str(e)
    return None


def test_disk_full_on_one_rank_stops_every_rank_with_one_line(pool2, tmp_path):
    root = str(tmp_path / "run")
    msgs = pool2.run(_save_with_full_disk_on, root, 1)
    assert msgs[0] is not None and msgs[0] == msgs[1], msgs
    assert "\n" not in msgs[0] and "No space left on device" in msgs[0] and "__1_0.distcp" in msgs[0], msgs[0]
    assert "free there" in msgs[0] and "needs about" in msgs[0] and "removed the partial save" in msgs[0], msgs[0]
    assert sorted(os.listdir(root)) == ["run.json", "step_00000001"] or sorted(os.listdir(root)) == ["step_00000001"]
    assert pool2.run(_try_load, f"{root}/step_00000001") == [None, None]
