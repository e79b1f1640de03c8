"""Hugging Face Qwen2-MoE and Qwen3-MoE <-> meshlm's MoETransformer on one process
(meshlm/interop/hf/qwen2_moe.py, meshlm/interop/hf/qwen3_moe.py): a random
Qwen2MoeForCausalLM (attention biases, a gated shared expert, gates not renormalised) and a
random Qwen3MoeForCausalLM (per-head query and key norms, gates renormalised), made locally
with transformers (no download), load with transformers' logits, greedy decoding and the
gradients a fine-tune steps with; they export to directories transformers loads with the
same tensors and logits; what meshlm cannot run or Qwen cannot express is refused by name.
Sharded loading and export: tests/dist/test_hf_qwen_moe_sharded.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness import tolerances as tol

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
KINDS = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _tiny(kind, path=None):
    from harness import hf_tiny

    return getattr(hf_tiny, f"tiny_{kind}")(path)


@pytest.fixture(scope="module", params=sorted(KINDS))
def qwen(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    m = _tiny(request.param, d)
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = m(tokens).logits
    return {"kind": request.param, "dir": d, "hf": m, "tokens": tokens, "ref": ref}


def _read_all(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_config_from_qwen_moe(qwen):
    from meshlm.interop.hf import read_hf_config

    cfg = read_hf_config(qwen["dir"])
    hf = qwen["hf"].config
    assert (cfg.experts, cfg.top_k, cfg.expert_mlp) == (hf.num_experts, hf.num_experts_per_tok, 32)
    assert (cfg.heads, cfg.kv_heads, cfg.embed, cfg.layers, cfg.norm_eps) == (8, 4, 64, 2, 1e-5)
    assert (cfg.capacity_factor, cfg.z_loss, cfg.norm_topk) == (None, 0.0, hf.norm_topk_prob)
    if qwen["kind"] == "qwen2_moe":
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.shared_mlp, cfg.shared_gate) == (True, False, 64, True)
    else:
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.shared_mlp, cfg.shared_gate) == (False, True, 0, False)


def test_logits_equal_transformers(qwen):
    from meshlm.interop.hf.load import load_hf_local

    ours = load_hf_local(qwen["dir"])
    with torch.no_grad():
        got = ours(qwen["tokens"])
    torch.testing.assert_close(got, qwen["ref"], **LOGIT_TOL)


def test_export_loads_in_transformers(qwen, tmp_path):
    from meshlm.interop.hf import save_hf
    from meshlm.interop.hf.load import load_hf_local

    out = str(tmp_path / "out")
    save_hf(load_hf_local(qwen["dir"]), out)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [KINDS[qwen["kind"]]]
    orig, got = _read_all(qwen["dir"]), _read_all(out)
    assert set(got) == set(orig)
    for k in orig:
        assert torch.equal(got[k], orig[k]), k
    back = getattr(transformers, KINDS[qwen["kind"]]).from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(qwen["tokens"]).logits, qwen["ref"], **LOGIT_TOL)


def test_greedy_generation_equals_transformers(qwen):
    """Decoding with meshlm's KV cache (the query/key norms and biases on each new token),
    two left-padded prompts of different lengths in one batch: transformers' greedy tokens."""
    from harness.hf_tiny import hf_greedy
    from meshlm.infer import generate
    from meshlm.interop.hf.load import load_hf_local

    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    want = hf_greedy(qwen["hf"], prompts, 8, until_eos=False)
    assert generate(load_hf_local(qwen["dir"]), prompts, max_new_tokens=8) == want


def test_fine_tune_gradients_equal_transformers(qwen):
    """What a fine-tune from the directory steps with: the loss and the gradient of every
    parameter equal transformers' (its fused expert ``gate_up_proj`` split into meshlm's
    gate and up, its biases and norms by their Hugging Face names), NOTE [implementation
    tolerance] in meshlm/train/tolerances.py."""
    from importlib import import_module

    from meshlm.interop.hf import read_hf_config
    from meshlm.interop.hf.load import load_hf_local
    from meshlm.train.tolerances import implementation_tol

    m = _tiny(qwen["kind"])
    tokens = qwen["tokens"]
    ref = m(tokens, labels=tokens).loss
    ref.backward()
    hf_grads = {n: p.grad for n, p in m.named_parameters()}
    ours = load_hf_local(qwen["dir"])
    loss = ours(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=tol.HF_LOSS_RTOL, atol=0)
    fam, cfg = import_module(f"meshlm.interop.hf.{qwen['kind']}"), read_hf_config(qwen["dir"])
    for fqn, p in ours.named_parameters():
        names = [n for n, _s in fam.hf_tensors(cfg, fqn, tuple(p.shape))]
        if len(names) > 1:  # an expert weight: transformers holds the experts fused
            i = fqn.split(".")[1]
            experts = m.model.layers[int(i)].mlp.experts
            mlp = experts.down_proj.shape[-1]
            want = {
                "w_gate": experts.gate_up_proj.grad[:, :mlp],
                "w_up": experts.gate_up_proj.grad[:, mlp:],
                "w_down": experts.down_proj.grad,
            }[fqn.rsplit(".", 1)[1]]
        else:
            want = hf_grads[names[0]].reshape(p.shape)
        err = (p.grad - want).abs()
        assert bool((err <= implementation_tol(want)).all()), (fqn, float(err.max()))


@pytest.mark.parametrize(
    "kind,key,value",
    [
        ("qwen3_moe", "decoder_sparse_step", 2),
        ("qwen3_moe", "mlp_only_layers", [1]),
        ("qwen3_moe", "use_sliding_window", True),
        ("qwen3_moe", "attention_bias", True),
        ("qwen3_moe", "hidden_act", "gelu"),
        ("qwen2_moe", "decoder_sparse_step", 2),
        ("qwen2_moe", "mlp_only_layers", [0]),
        ("qwen2_moe", "shared_expert_intermediate_size", 0),
    ],
)
def test_config_meshlm_cannot_load(tmp_path, kind, key, value):
    from importlib import import_module

    from meshlm.core.errors import ConfigError

    hf = _tiny(kind).config.to_dict()
    with pytest.raises(ConfigError, match=key):
        import_module(f"meshlm.interop.hf.{kind}").config_from_hf({**hf, key: value})


def test_meshlm_shared_expert_model_exports_as_qwen2_moe(tmp_path):
    """meshlm's own ``moe_shared_tiny`` (a gated shared expert, no attention bias) is a
    Qwen2-MoE (``qkv_bias: false``): transformers loads the export with meshlm's logits."""
    from meshlm.interop.hf import save_hf
    from meshlm.models import MoETransformer, moe_config

    m = MoETransformer(moe_config("moe_shared_tiny", z_loss=0.0, init_std=0.1), seed=0).eval()
    with torch.no_grad():
        for blk in m.layers:
            blk.attn_norm.weight.add_(0.1)
    save_hf(m, str(tmp_path / "out"))
    hf = json.load(open(tmp_path / "out" / "config.json"))
    assert (hf["model_type"], hf["qkv_bias"], hf["norm_topk_prob"]) == ("qwen2_moe", False, True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    back = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, m(tokens), **LOGIT_TOL)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"qk_norm": True, "shared_mlp": 16}, "model.shared_mlp=16: .*Qwen3-MoE"),
        ({"qk_norm": True, "qkv_bias": True}, "model.qkv_bias=True: .*Qwen3-MoE"),
        ({"qkv_bias": True}, "model.shared_mlp=0: .*Qwen2-MoE"),
        ({"qkv_bias": True, "shared_mlp": 16}, "model.shared_gate=False: .*Qwen2-MoE"),
        ({"qk_norm": True, "capacity_factor": 1.0}, "model.capacity_factor=1.0: .*Qwen-MoE"),
    ],
)
def test_export_refuses_what_qwen_cannot_express(tmp_path, overrides, match):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf import save_hf
    from meshlm.models import MoETransformer, moe_config

    m = MoETransformer(moe_config("moe_tiny", z_loss=0.0, **overrides), device="meta")
    with pytest.raises(ConfigError, match=match):
        save_hf(m, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_llama_export_refuses_qwen_attention(tmp_path):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf import save_hf
    from meshlm.models import Llama, llama_config

    with pytest.raises(ConfigError, match="model.qk_norm=True: .*Llama"):
        save_hf(Llama(llama_config("llama_tiny", qk_norm=True), device="meta"), str(tmp_path / "out"))
