"""Hugging Face interop: a tiny random GQA Llama built locally with transformers (offline).

meshlm's logits equal transformers' under every shipped layout on 4 gloo ranks; export
(from a live sharded model, and from a training checkpoint with `meshlm convert`, run
distributed) reproduces the original safetensors exactly and loads in transformers."""

from __future__ import annotations

import os

import pytest
import torch

from harness import dist_pool_fixture
from harness import tolerances as tol

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)

LAYOUT_MESH = {
    "single": "dp=4", "ddp": "dp=4", "zero1": "dp=4", "zero2": "dp=4", "fsdp": "fsdp=4",
    "hsdp": "dp=2,fsdp=2", "tp": "tp=4", "tp_sp": "tp=4", "fsdp_tp": "fsdp=2,tp=2", "fsdp_tp_sp": "fsdp=2,tp=2",
}


def _hf_model():
    from harness.hf_tiny import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    m = _hf_model()
    single, sharded = str(d / "single"), str(d / "sharded")
    m.save_pretrained(single, safe_serialization=True)
    m.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(tokens).logits
    return {"single": single, "sharded": sharded, "tokens": tokens, "ref": ref, "root": str(d)}


pool4 = dist_pool_fixture(4, timeout_s=60)


def _logits(path, layout, mesh_shape, tokens, export_to=None):
    import meshlm
    from meshlm.interop.hf import load_hf, save_hf

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(mesh_shape)
    model = load_hf(path, layout, mesh)
    with torch.no_grad():
        out = model(meshlm.shard_batch(tokens, layout, mesh))
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    if export_to:
        save_hf(model, export_to)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUT_MESH))
def test_logits_match_transformers(pool4, hf_dirs, layout):
    which = "sharded" if layout in ("fsdp", "fsdp_tp") else "single"  # both file forms
    got = pool4.run(_logits, hf_dirs[which], layout, LAYOUT_MESH[layout], hf_dirs["tokens"])
    for r in got:
        torch.testing.assert_close(r, hf_dirs["ref"], **LOGIT_TOL)


def _read_all(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _assert_same_tensors(a: str, b: str) -> None:
    ta, tb = _read_all(a), _read_all(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k], tb[k]), k  # exact: export moves bytes only


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_export_round_trip(pool4, hf_dirs, layout):
    out = os.path.join(hf_dirs["root"], f"export_{layout}")
    pool4.run(_logits, hf_dirs["sharded"], layout, LAYOUT_MESH[layout], hf_dirs["tokens"], out)
    _assert_same_tensors(hf_dirs["single"], out)
    m = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(m(hf_dirs["tokens"]).logits, hf_dirs["ref"], rtol=0, atol=0)


def _convert_both_ways(hf, ckpt_root, out):
    from meshlm.train.convert import convert_main

    assert convert_main([hf, ckpt_root]) == 0  # HF -> meshlm checkpoint (fsdp=4)
    torch._dynamo.reset()
    return convert_main([ckpt_root, out, "--layout", "fsdp_tp", "--mesh", "fsdp=2,tp=2"])


def test_convert_distributed(pool4, hf_dirs):
    ck, out = os.path.join(hf_dirs["root"], "ckpt"), os.path.join(hf_dirs["root"], "converted")
    assert pool4.run(_convert_both_ways, hf_dirs["single"], ck, out) == [0] * 4
    _assert_same_tensors(hf_dirs["single"], out)


def test_convert_single_process(hf_dirs, tmp_path):
    """`meshlm convert` without torchrun: a checkpoint saved on 4 ranks, exported by one."""
    import subprocess
    import sys

    ck = os.path.join(hf_dirs["root"], "ckpt")
    if not os.path.isdir(ck):
        pytest.skip("needs test_convert_distributed's checkpoint")
    code = ("import sys; from meshlm.train.convert import convert_main; "
            f"sys.exit(convert_main([{ck!r}, {str(tmp_path / 'out')!r}]))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_tensors(hf_dirs["single"], str(tmp_path / "out"))


def test_bad_hf_dir(tmp_path):
    from meshlm.core.errors import CheckpointError
    from meshlm.interop.hf import read_hf_config

    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_hf_config(str(tmp_path))


def _built_onto_the_tier(path, base, tokens):
    import meshlm
    from meshlm.core.annotate import outer_blocks
    from meshlm.interop.hf import load_hf
    from meshlm.runtime.memory import local_data
    from meshlm.runtime.offload.params import ParamOffload
    from meshlm.runtime.offload.store import SwapDir, Swapper, owns_storage

    torch._dynamo.reset()
    rank = torch.distributed.get_rank()
    sw = Swapper("disk", SwapDir(base, rank, run_id="hf-tier"))
    mesh = meshlm.make_mesh("fsdp=4")
    built, model = [], None

    def spill(blk):  # as meshlm train's Offload.spill: out as soon as made (and read)
        for p in blk.parameters():
            if owns_storage(local_data(p)):
                sw.swap_out(local_data(p))
        built.append(sum(local_data(p).untyped_storage().nbytes() for p in blk.parameters()))

    model = load_hf(path, "fsdp", mesh, after_block=spill)
    off = ParamOffload(model, sw)  # adopts the blocks already on disk
    with torch.no_grad():
        out = model(meshlm.shard_batch(tokens, "fsdp", mesh))
    off.close()
    return built, len(outer_blocks(model)), out.full_tensor() if hasattr(out, "full_tensor") else out


def test_built_onto_the_tier_from_the_files(pool4, hf_dirs, tmp_path):
    """load_hf(after_block=...), as meshlm train builds an offloaded model from model.init_from:
    each block is read and moved to disk before the next is made, and the logits of the
    model streamed back from disk are transformers'."""
    for built, blocks, logits in pool4.run(_built_onto_the_tier, hf_dirs["single"], str(tmp_path), hf_dirs["tokens"]):
        assert len(built) == blocks == 2 and built == [0, 0]
        torch.testing.assert_close(logits, hf_dirs["ref"], **LOGIT_TOL)
