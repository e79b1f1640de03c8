"""Hugging Face Mixtral <-> meshlm's MoETransformer on one process (meshlm/interop/hf/mixtral.py):
a random MixtralForCausalLM made locally with transformers (no download) loads with
transformers' logits, exports to a directory transformers loads with the same logits and
the same tensors, and what Mixtral cannot express is refused by name.  Sharded loading and
export (fsdp_ep) are tests/dist/test_hf_mixtral_sharded.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness import tolerances as tol

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from harness.hf_tiny import tiny_mixtral

    d = str(tmp_path_factory.mktemp("mixtral"))
    m = tiny_mixtral(d)
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = m(tokens).logits
    return {"dir": d, "hf": m, "tokens": tokens, "ref": ref}


def _read_all(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_config_from_mixtral(mixtral):
    from meshlm.interop.hf import read_hf_config

    cfg = read_hf_config(mixtral["dir"])
    hf = mixtral["hf"].config
    assert (cfg.experts, cfg.top_k, cfg.expert_mlp) == (hf.num_local_experts, hf.num_experts_per_tok, 32)
    assert (cfg.shared_mlp, cfg.capacity_factor, cfg.norm_topk, cfg.z_loss) == (0, None, True, 0.0)
    assert (cfg.heads, cfg.kv_heads, cfg.embed, cfg.layers) == (8, 4, 64, 2)


def test_logits_equal_transformers(mixtral):
    from meshlm.interop.hf.load import load_hf_local

    ours = load_hf_local(mixtral["dir"])
    with torch.no_grad():
        got = ours(mixtral["tokens"])
    torch.testing.assert_close(got, mixtral["ref"], **LOGIT_TOL)


def test_export_loads_in_transformers(mixtral, tmp_path):
    from meshlm.interop.hf import save_hf
    from meshlm.interop.hf.load import load_hf_local

    out = str(tmp_path / "out")
    save_hf(load_hf_local(mixtral["dir"]), out)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["MixtralForCausalLM"]
    orig, got = _read_all(mixtral["dir"]), _read_all(out)
    assert set(got) == set(orig)
    for k in orig:
        assert torch.equal(got[k], orig[k]), k
    back = transformers.MixtralForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(mixtral["tokens"]).logits, mixtral["ref"], **LOGIT_TOL)


@pytest.mark.parametrize(
    "field,value", [("shared_mlp", 16), ("capacity_factor", 1.0), ("norm_topk", False), ("z_loss", 0.001)]
)
def test_export_refuses_what_mixtral_cannot_express(tmp_path, field, value):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf import save_hf
    from meshlm.models import MoETransformer, moe_config

    m = MoETransformer(moe_config("moe_tiny", **{"z_loss": 0.0, field: value}))
    with pytest.raises(ConfigError, match=f"model.{field}=.*Mixtral"):
        save_hf(m, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_export_refuses_a_selection_bias(tmp_path):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf import save_hf
    from meshlm.models import MoETransformer, moe_config

    m = MoETransformer(moe_config("moe_tiny", z_loss=0.0))
    m.layers[1].moe.selection_bias[3] = 0.5
    with pytest.raises(ConfigError, match="layers.1.moe.selection_bias"):
        save_hf(m, str(tmp_path / "out"))


@pytest.mark.parametrize("key,value", [("sliding_window", 4096), ("router_jitter_noise", 0.01), ("hidden_act", "gelu")])
def test_config_mixtral_cannot_load(mixtral, tmp_path, key, value):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf.mixtral import config_from_hf

    hf = json.load(open(os.path.join(mixtral["dir"], "config.json")))
    with pytest.raises(ConfigError, match=key):
        config_from_hf({**hf, key: value})


def test_greedy_generation_equals_transformers(mixtral):
    """Decoding with meshlm's KV cache through the experts, two left-padded prompts of
    different lengths in one batch: transformers' greedy tokens."""
    from harness.hf_tiny import hf_greedy
    from meshlm.infer import generate
    from meshlm.interop.hf.load import load_hf_local

    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    want = hf_greedy(mixtral["hf"], prompts, 8, until_eos=False)
    assert generate(load_hf_local(mixtral["dir"]), prompts, max_new_tokens=8) == want
