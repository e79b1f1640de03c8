"""meshlm.models.GPT2 on one device: the Hydra nodes conf/model/gpt2*.yaml build the shipped
configs through their `_target_`, and bad fields or inputs are clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshlm.core.errors import ConfigError
from meshlm.models import GPT2, GPT2_CONFIGS, GPT2Config, gpt2_model

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
MESHLM_KEYS = ("name", "init_from")  # meshlm's own keys of a model node, not the model's arguments


@pytest.mark.parametrize("name", sorted(GPT2_CONFIGS))
def test_conf_node_instantiates_the_shipped_config(name):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = CONF / f"{name}.yaml"
    node = OmegaConf.load(path)
    assert node.name == name and node._target_ == "meshlm.models.gpt2_model"
    model = instantiate({k: v for k, v in node.items() if k not in MESHLM_KEYS}, device="meta")
    assert isinstance(model, GPT2) and model.cfg == GPT2_CONFIGS[name]
    assert next(model.parameters()).device.type == "meta"
    n = sum(p.numel() for p in model.parameters())
    assert n == model.cfg.num_params()
    stated = re.search(r"\(([\d.]+)M parameters\)", path.read_text().splitlines()[0])
    assert stated and float(stated.group(1)) == round(n / 1e6, 1), (stated, n)


def test_tied_head_is_the_token_embedding():
    m = gpt2_model(seed=0)
    assert m.lm_head.weight is m.transformer.wte.weight
    untied = gpt2_model(seed=0, tie_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert len(list(untied.parameters())) == len(list(m.parameters())) + 1


def test_logits_and_loss():
    m = gpt2_model(seed=0)
    x = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    logits = m(x)
    assert logits.shape == (2, 10, 256)
    torch.testing.assert_close(
        m(x, x), torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()), rtol=0, atol=0
    )


def test_unknown_field_is_named():
    with pytest.raises(
        ConfigError, match=r"model.n_embd: GPT-2 has no such field \(did you mean 'embed'\?\); its fields"
    ):
        gpt2_model(device="meta", n_embd=64)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(embed=64, heads=3), r"model.embed=64 is not divisible by model.heads=3"),
        (dict(layers=0), r"model.layers=0 must be a positive integer"),
        (dict(mlp=-4), r"model.mlp=-4 must be a positive integer"),
        (dict(dropout=1.0), r"model.dropout=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_config_is_named(kw, match):
    with pytest.raises(ConfigError, match=match):
        GPT2Config(**kw)


def test_sequence_longer_than_the_positions():
    m = gpt2_model(seed=0, block_size=8)
    m(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"9 tokens is longer than model.block_size=8"):
        m(torch.zeros(1, 9, dtype=torch.long))
