"""Hugging Face Mixtral under expert parallel (meshlm/interop/hf/mixtral.py): a random
MixtralForCausalLM made locally with transformers (no download) loads on 4 gloo ranks under
fsdp_ep (fsdp=2, ep=2: each ep rank reads only its experts' tensors, each fsdp rank its rows
of them) and fsdp_tp (each tp rank its columns of every expert) with transformers' logits,
and a model sharded under fsdp_ep exports the original tensors exactly, which transformers
loads with the same logits.  One process: tests/unit/test_hf_mixtral.py."""

from __future__ import annotations

import os

import pytest
import torch

from harness import dist_pool_fixture
from harness import tolerances as tol

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
LAYOUT_MESH = {"fsdp_ep": "fsdp=2,ep=2", "fsdp_tp": "fsdp=2,tp=2"}

pool4 = dist_pool_fixture(4, timeout_s=60)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from harness.hf_tiny import tiny_mixtral

    root = tmp_path_factory.mktemp("mixtral")
    d = str(root / "hf")
    m = tiny_mixtral(d)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = m(tokens).logits
    return {"dir": d, "root": str(root), "tokens": tokens, "ref": ref}


def _logits(path, layout, mesh_shape, tokens, export_to=None):
    import meshlm
    from meshlm.interop.hf import load_hf, save_hf

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(mesh_shape)
    model = load_hf(path, layout, mesh)
    experts = model.layers[0].moe.w_gate
    local = tuple(experts.to_local().shape)
    with torch.no_grad():
        out = model(meshlm.shard_batch(tokens, layout, mesh))
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    if export_to:
        save_hf(model, export_to)
    return out, local


@pytest.mark.parametrize("layout", sorted(LAYOUT_MESH))
def test_logits_match_transformers_sharded(pool4, mixtral, layout):
    results = pool4.run(_logits, mixtral["dir"], layout, LAYOUT_MESH[layout], mixtral["tokens"])
    for out, local in results:
        torch.testing.assert_close(out, mixtral["ref"], **LOGIT_TOL)
        # the layout did shard the experts: (experts, mlp, embed) = (8, 32, 64) whole
        assert local[0] * local[1] * local[2] < 8 * 32 * 64


def test_export_round_trip_fsdp_ep(pool4, mixtral):
    from safetensors.torch import load_file

    out = os.path.join(mixtral["root"], "export_fsdp_ep")
    pool4.run(_logits, mixtral["dir"], "fsdp_ep", LAYOUT_MESH["fsdp_ep"], mixtral["tokens"], out)
    orig = load_file(os.path.join(mixtral["dir"], "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(orig)
    for k in orig:
        assert torch.equal(got[k], orig[k]), k  # exact: export moves bytes only
    m = transformers.MixtralForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(m(mixtral["tokens"]).logits, mixtral["ref"], rtol=0, atol=0)


def _convert_both_ways(hf, ckpt_root, out):
    from meshlm.train.convert import convert_main

    assert convert_main([hf, ckpt_root]) == 0  # HF -> meshlm checkpoint (fsdp=4)
    torch._dynamo.reset()
    return convert_main([ckpt_root, out, "--layout", "fsdp_ep", "--mesh", "fsdp=2,ep=2"])


def test_convert_through_a_checkpoint(pool4, mixtral):
    """`meshlm convert` both ways: Mixtral -> a meshlm checkpoint -> Mixtral (under fsdp_ep),
    the tensors exactly the original's."""
    from safetensors.torch import load_file

    ck, out = os.path.join(mixtral["root"], "ckpt"), os.path.join(mixtral["root"], "converted")
    assert pool4.run(_convert_both_ways, mixtral["dir"], ck, out) == [0] * 4
    orig = load_file(os.path.join(mixtral["dir"], "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(orig)
    for k in orig:
        assert torch.equal(got[k], orig[k]), k


def _grads(path, tokens):
    import meshlm

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(LAYOUT_MESH["fsdp_ep"])
    model = meshlm.load_hf(path, "fsdp_ep", mesh)
    loss = model(
        meshlm.shard_batch(tokens[:, :-1], "fsdp_ep", mesh), meshlm.shard_batch(tokens[:, 1:], "fsdp_ep", mesh)
    )
    loss.backward()
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    params = dict(model.named_parameters())
    names = ("router", "w_gate", "w_up", "w_down")
    return loss.detach(), {n: params[f"layers.0.moe.{n}"].grad.full_tensor() for n in names}


def test_fine_tune_gradients_match_transformers(pool4, mixtral):
    """What a fine-tune from a Mixtral steps with, under fsdp_ep: the loss and the gradients
    of the router and of every expert equal transformers' (its fused ``gate_up_proj`` split
    into meshlm's gate and up), NOTE [implementation tolerance]."""
    from harness.hf_tiny import tiny_mixtral
    from meshlm.train.tolerances import implementation_tol

    m = tiny_mixtral()
    tokens = mixtral["tokens"]
    ref = m(tokens, labels=tokens).loss
    ref.backward()
    hf = m.model.layers[0].mlp
    mlp = hf.experts.down_proj.shape[-1]
    want = {
        "router": hf.gate.weight.grad,
        "w_gate": hf.experts.gate_up_proj.grad[:, :mlp],
        "w_up": hf.experts.gate_up_proj.grad[:, mlp:],
        "w_down": hf.experts.down_proj.grad,
    }
    for loss, grads in pool4.run(_grads, mixtral["dir"], tokens):
        torch.testing.assert_close(loss, ref.detach(), rtol=tol.HF_LOSS_RTOL, atol=0)
        for n, g in grads.items():
            err = (g - want[n]).abs()
            assert bool((err <= implementation_tol(want[n])).all()), (n, float(err.max()))
