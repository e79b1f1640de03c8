"""Hugging Face Qwen2-MoE and Qwen3-MoE sharded (meshlm/interop/hf/qwen2_moe.py,
meshlm/interop/hf/qwen3_moe.py): a random Qwen2MoeForCausalLM (attention biases, a gated
shared expert) and Qwen3MoeForCausalLM (per-head query and key norms), made locally with
transformers (no download), load on 4 gloo ranks under fsdp_ep (fsdp=2, ep=2: each ep rank
reads only its experts' tensors) and fsdp_tp (fsdp=2, tp=2: each tp rank its heads' biases
and its columns of every expert) with transformers' logits; a model sharded under fsdp_ep
exports the original tensors exactly, which transformers loads with the same logits, and
the loss and gradients a fine-tune steps with under fsdp_ep equal transformers'.  One
process: tests/unit/test_hf_qwen_moe.py."""

from __future__ import annotations

import os

import pytest
import torch

from harness import dist_pool_fixture
from harness import tolerances as tol

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
LAYOUT_MESH = {"fsdp_ep": "fsdp=2,ep=2", "fsdp_tp": "fsdp=2,tp=2"}
KINDS = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

pool4 = dist_pool_fixture(4, timeout_s=60)


def _tiny(kind, path=None):
    from harness import hf_tiny

    return getattr(hf_tiny, f"tiny_{kind}")(path)


@pytest.fixture(scope="module", params=sorted(KINDS))
def qwen(request, tmp_path_factory):
    pytest.importorskip("transformers")  # here, not at import: the ranks import this module and need it not
    root = tmp_path_factory.mktemp(request.param)
    d = str(root / "hf")
    m = _tiny(request.param, d)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = m(tokens).logits
    return {"kind": request.param, "dir": d, "root": str(root), "tokens": tokens, "ref": ref}


def _logits(path, layout, mesh_shape, tokens, export_to=None):
    import meshlm
    from meshlm.interop.hf import load_hf, save_hf

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(mesh_shape)
    model = load_hf(path, layout, mesh)
    attn, moe = model.layers[0].attn, model.layers[0].moe
    head_param = attn.bq if attn.bq is not None else attn.q_norm.weight
    local = tuple(moe.w_gate.to_local().shape), tuple(head_param.to_local().shape)
    with torch.no_grad():
        out = model(meshlm.shard_batch(tokens, layout, mesh))
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    if export_to:
        save_hf(model, export_to)
    return out, local


@pytest.mark.parametrize("layout", sorted(LAYOUT_MESH))
def test_logits_match_transformers_sharded(pool4, qwen, layout):
    results = pool4.run(_logits, qwen["dir"], layout, LAYOUT_MESH[layout], qwen["tokens"])
    for out, (experts, head) in results:
        torch.testing.assert_close(out, qwen["ref"], **LOGIT_TOL)
        # the layout did shard the experts: (experts, mlp, embed) = (8, 32, 64) whole
        assert experts[0] * experts[1] * experts[2] < 8 * 32 * 64
        if layout == "fsdp_tp" and qwen["kind"] == "qwen2_moe":
            assert head == (4, 8)  # bq (heads, head_dim): each tp rank its 4 of 8 heads


def test_export_round_trip_fsdp_ep(pool4, qwen):
    import transformers
    from safetensors.torch import load_file

    out = os.path.join(qwen["root"], "export_fsdp_ep")
    pool4.run(_logits, qwen["dir"], "fsdp_ep", LAYOUT_MESH["fsdp_ep"], qwen["tokens"], out)
    orig = load_file(os.path.join(qwen["dir"], "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(orig)
    for k in orig:
        assert torch.equal(got[k], orig[k]), k  # exact: export moves bytes only
    m = getattr(transformers, KINDS[qwen["kind"]]).from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(m(qwen["tokens"]).logits, qwen["ref"], rtol=0, atol=0)


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
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if n.startswith("layers.0.")}
    return loss.detach(), grads


def test_fine_tune_gradients_match_transformers(pool4, qwen):
    """What a fine-tune from the directory steps with, under fsdp_ep: the loss and the
    gradients of layer 0 (attention with its biases or norms, router, experts, shared
    expert and its gate) equal transformers', NOTE [implementation tolerance]."""
    from meshlm.train.tolerances import implementation_tol

    m = _tiny(qwen["kind"])
    tokens = qwen["tokens"]
    ref = m(tokens, labels=tokens).loss
    ref.backward()
    layer = m.model.layers[0]
    mlp = layer.mlp.experts.down_proj.shape[-1]
    want = {
        "attn_norm.weight": layer.input_layernorm.weight.grad,
        "mlp_norm.weight": layer.post_attention_layernorm.weight.grad,
        "attn.wo": layer.self_attn.o_proj.weight.grad,
        "moe.router": layer.mlp.gate.weight.grad,
        "moe.w_gate": layer.mlp.experts.gate_up_proj.grad[:, :mlp],
        "moe.w_up": layer.mlp.experts.gate_up_proj.grad[:, mlp:],
        "moe.w_down": layer.mlp.experts.down_proj.grad,
    }
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
        want[f"attn.{ours}"] = getattr(layer.self_attn, theirs).weight.grad
    if qwen["kind"] == "qwen2_moe":
        for ours, theirs in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            want[f"attn.{ours}"] = getattr(layer.self_attn, theirs).bias.grad
        shared = layer.mlp.shared_expert
        want.update(
            {
                "moe.shared_gate_proj": shared.gate_proj.weight.grad,
                "moe.shared_up": shared.up_proj.weight.grad,
                "moe.shared_down": shared.down_proj.weight.grad,
                "moe.shared_gate": layer.mlp.shared_expert_gate.weight.grad,
            }
        )
    else:
        want["attn.q_norm.weight"] = layer.self_attn.q_norm.weight.grad
        want["attn.k_norm.weight"] = layer.self_attn.k_norm.weight.grad
    for loss, grads in pool4.run(_grads, qwen["dir"], tokens):
        torch.testing.assert_close(loss, ref.detach(), rtol=tol.HF_LOSS_RTOL, atol=0)
        assert sorted(grads) == sorted(f"layers.0.{n}" for n in want)
        for n, w in want.items():
            g = grads[f"layers.0.{n}"].reshape(w.shape)
            err = (g - w).abs()
            assert bool((err <= implementation_tol(w)).all()), (n, float(err.max()))
