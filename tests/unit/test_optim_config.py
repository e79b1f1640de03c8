"""The ``optim`` node (NOTE [optim node] in meshlm/app/optimizer.py) and the no-decay rules
(NOTE [no-decay rules] in meshlm/train/param_groups.py): what composes, and the errors that
name the key."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from harness.simworld import fake_mesh
from meshlm.app.config import load_config
from meshlm.core.errors import ConfigError


@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides,target,args",
    [
        ([], "torch.optim.AdamW", {"betas": [0.9, 0.95], "weight_decay": 0.1}),
        (["optim=sgd"], "torch.optim.SGD", {"momentum": 0.9}),
        (["optim=adafactor"], "torch.optim.Adafactor", {}),
        # a _target_ without a group starts from the empty node: AdamW's betas do not reach SGD
        (["optim._target_=torch.optim.SGD", "optim.nesterov=true", "optim.momentum=0.5"], "torch.optim.SGD",
         {"nesterov": True, "momentum": 0.5}),
    ],
)  # fmt: skip
def test_optim_composes(overrides, target, args):
    o = load_config(overrides).optim
    assert (o.target, o.args) == (target, args)


@pytest.mark.parametrize(
    "override,words",
    [
        ("optim.lr=0.1", ["optim.lr", "train.lr", "train.schedule"]),
        ("optim.betaz=[0.9,0.9]", ["optim.betaz", "torch.optim.AdamW", "betas"]),
        ("optim._target_=torch.optim.NoSuch", ["optim._target_=torch.optim.NoSuch", "no attribute 'NoSuch'"]),
        ("optim._target_=math.pi", ["optim._target_=math.pi", "not an optimizer class"]),
        ("optim=nosuch", ["optim=nosuch", "adamw", "sgd"]),
        ("optim.weight_decay=lots", ["optim.weight_decay='lots'", "number"]),
        ("train.weight_decay=0.2", ["train.weight_decay", "optim.weight_decay=0.2"]),
        ("train.beta2=0.99", ["train.beta2", "optim.betas"]),
        ("train.schedule=step", ["train.schedule", "cosine", "wsd"]),
        ("train.decay_frac=2", ["train.decay_frac", "[0, 1]"]),
        ("optim.no_decay=[axes:]", ["optim.no_decay", "axes:AXIS"]),
    ],
)
def test_bad_optim_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    for w in words:
        assert w in str(e.value)


def test_impl_the_class_cannot_take_is_an_error():
    import torch

    from meshlm.app.optimizer import impl_kwargs

    cfg = load_config(["optim=adafactor", "train.optimizer_impl=fused"])
    with pytest.raises(ConfigError, match="train.optimizer_impl=fused: torch.optim.Adafactor takes no 'fused'"):
        impl_kwargs(cfg.optim, cfg.train, None, torch.device("cpu"))
    cfg = load_config(["optim=sgd", "train.optimizer_impl=foreach"])
    assert impl_kwargs(cfg.optim, cfg.train, None, torch.device("cpu")) == {"foreach": True}


def test_no_decay_rules_pick_by_axes_and_by_name(fake_world):
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.train.param_groups import no_decay_groups

    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "fsdp", fake_mesh({"fsdp": 2}))
    plain = dict(Llama(llama_config("llama_tiny"), device="meta").named_parameters())
    (g,) = no_decay_groups(model, ["axes:embed"])
    assert g["weight_decay"] == 0.0 and sorted(g["params"]) == sorted(n for n, p in plain.items() if p.ndim == 1)
    (g,) = no_decay_groups(model, ["*.attn_norm.weight"])
    assert sorted(g["params"]) == sorted(n for n in plain if n.endswith(".attn_norm.weight"))
    assert no_decay_groups(model, []) == []
    with pytest.raises(ConfigError, match=r"optim.no_decay: the rule 'axes:mlp' matches no parameter.*axes:embed"):
        no_decay_groups(model, ["axes:mlp"])
