"""The ``model`` node (NOTE [model node] in meshlm/model_config.py): any ``_target_`` that
returns an nn.Module, built on the meta device, with errors that name ``model.<key>``; the
loss contract (``loss_of``) and the model's vocabulary (``model_vocab``); ``meshlm layout
show`` for a user's model from a package outside meshlm (tests/usermodel/mymodels)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshlm.config import ModelConfig, build_model, from_dict, load_config
from meshlm.errors import AnnotationError, ConfigError
from meshlm.model_config import loss_of, model_vocab

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")


@pytest.fixture(autouse=True)
def _usermodel_on_path(monkeypatch):
    monkeypatch.syspath_prepend(USERMODEL)


def test_user_target_starts_from_an_empty_node():
    cfg = load_config(["model._target_=mymodels.TinyLM", "model.width=16", "model.heads=2"])
    assert (cfg.model.target, cfg.model.args, cfg.model.label) == (
        "mymodels.TinyLM",
        {"width": 16, "heads": 2},
        "TinyLM",
    )
    m = build_model(cfg.model)
    assert m.wte.weight.shape == (256, 16) and all(p.is_meta for p in m.parameters())
    assert from_dict(cfg.to_dict()) == cfg  # what checkpoints and config.yaml save comes back


def test_shipped_node_keeps_its_keys_and_takes_overrides():
    cfg = load_config(["model=llama_tiny", "model.layers=3"])
    assert cfg.model.name == "llama_tiny" and cfg.model.args["layers"] == 3 and cfg.model.args["embed"] == 64
    m = build_model(cfg.model)
    assert len(m.layers) == 3 and next(m.parameters()).is_meta
    # a target swapped on a shipped node keeps that node's keys, which this target does not take
    with pytest.raises(ConfigError, match="model.embed: mymodels.TinyLM takes no argument 'embed'"):
        load_config(["model=llama_tiny", "model._target_=mymodels.TinyLM"])


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model._target_=mymodels.TinyLM", "model.widht=3"], ["model.widht", "takes no argument", "width, depth"]),
        (["model._target_=torch.nn.Linear", "model.in_features=3"], ["model.out_features is required"]),
        (["model._target_=mymodels.NoSuch"], ["model._target_=mymodels.NoSuch", "no attribute 'NoSuch'"]),
        (["model._target_=nosuchpkg.Model"], ["no module named 'nosuchpkg'", "PYTHONPATH"]),
        (["model._target_=mymodels"], ["is a module, not a callable"]),
        (["model=custom"], ["model._target_ is not set", "model=llama_tiny"]),
        (["model._target_=mymodels.TinyLM", "model.device=cpu"], ["model.device='cpu'", "drop model.device"]),
    ],
)
def test_bad_node_names_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_contract_breaks_at_build():
    with pytest.raises(ConfigError, match=r"mymodels.not_a_model returned a Tensor, not a torch.nn.Module"):
        build_model(ModelConfig(target="mymodels.not_a_model"))
    # a target without a device argument is built inside torch.device("meta")
    m = build_model(ModelConfig(target="mymodels.NoDevice", args={"width": 8}))
    assert m.wte.weight.shape == (256, 8) and all(p.is_meta for p in m.parameters())
    m = build_model(ModelConfig(target="mymodels.TinyLM"), "cpu")
    assert not any(p.is_meta for p in m.parameters())


def test_loss_of_takes_a_scalar_or_a_loss_entry():
    cfg = ModelConfig(target="mymodels.TinyLM")
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    assert loss_of(loss, cfg) is loss
    assert loss_of({"loss": loss, "logits": w}, cfg) is loss
    assert loss_of(SimpleNamespace(loss=loss), cfg) is loss
    with pytest.raises(
        ConfigError, match=r"model TinyLM: forward\(tokens, targets\) returned a tensor of shape \(3,\)"
    ):
        loss_of(w * 2, cfg)
    with pytest.raises(ConfigError, match="returned a tuple"):
        loss_of((w, loss), cfg)
    with pytest.raises(ConfigError, match="returned a dict without a 'loss' entry"):
        loss_of({"logits": w}, cfg)
    with pytest.raises(ConfigError, match="returned a torch.int64 scalar"):
        loss_of(torch.tensor(3), cfg)
    with pytest.raises(ConfigError, match="does not depend on any trainable parameter"):
        loss_of(torch.tensor(1.0), cfg)
    with torch.no_grad():  # evaluation
        assert float(loss_of((w * 2).sum(), cfg)) == 6.0


def test_model_vocab_is_the_size_of_the_vocab_axis():
    assert model_vocab(build_model(ModelConfig(target="mymodels.TinyLM", args={"vocab": 100}))) == 100
    assert model_vocab(build_model(load_config(["model=llama_tiny", "model.vocab=300"]).model)) == 300
    assert model_vocab(torch.nn.Linear(2, 2)) is None


def test_layout_show_user_model(capsys):
    from meshlm.cli import main

    assert (
        main(["layout", "show", "fsdp_tp", "--mesh", "fsdp=2,tp=2", "model._target_=mymodels.TinyLM", "model.width=16"])
        == 0
    )
    out = capsys.readouterr().out
    assert "model TinyLM" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("blocks.1.attn.q.weight"))
    assert row[1:4] == ["(heads,", "embed)", "fsdp:S(1)"] and "16x16" in row and "8x8" in row
    assert main(["layout", "show", "fsdp", "--mesh", "fsdp=2", "model._target_=mymodels.Unannotated"]) == 1
    assert "scale" in capsys.readouterr().err


def test_unannotated_parameter_is_named():
    from meshlm.show import layout_rows

    with pytest.raises(AnnotationError, match="scale"):
        layout_rows(ModelConfig(target="mymodels.Unannotated"), "fsdp", "fsdp=2")
