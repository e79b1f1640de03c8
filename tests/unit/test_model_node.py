"""The ``model`` node (NOTE [model node] in meshlm/models/node.py): any ``_target_`` that
returns an nn.Module, built on the meta device, with errors that name ``model.<key>``; the
loss contract (``loss_of``) and the model's vocabulary (``model_vocab``); ``meshlm layout
show`` for a user's model from a package outside meshlm (tests/usermodel/mymodels)."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Literal, Optional

import pytest
import torch

from meshlm.app.config import ModelConfig, from_dict, load_config
from meshlm.app.model_build import build_model, model_vocab
from meshlm.core.errors import AnnotationError, ConfigError
from meshlm.models.node import loss_of

if TYPE_CHECKING:
    from unknown_package import Unknown  # only for a type checker: the annotation cannot be read at run time

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


@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            ["model=llama_tiny", "model.embed=big"],
            ["model.embed='big' is not an integer", "embed is int", "model.embed=64"],
        ),
        (["model=llama_tiny", "model.norm_eps=small"], ["model.norm_eps='small' is not a number"]),
        (["model=llama_tiny", "model.tie_embeddings=1"], ["model.tie_embeddings=1 is not true or false"]),
        (["model=llama_tiny", "model.layers=2.0"], ["model.layers=2.0 is not an integer"]),
        (["model=gpt2_tiny", "model.embed=big"], ["model.embed='big'", "meshlm.models.gpt2_model's embed is int"]),
        (["model=gpt2_tiny", "model.seed=x"], ["model.seed='x' is not an integer (or null)"]),
        (["model=vlm_tiny", "model.vision_embed=big"], ["model.vision_embed='big' is not an integer"]),
        (["model=vlm_tiny", "model.language.embed=big"], ["model.language: model.embed='big' is not an integer"]),
        (["model=vlm_tiny", "model.pixel_mean=[0.5,a,0.5]"], ["model.pixel_mean", "a list of numbers (or null)"]),
        (["model._target_=mymodels.TinyLM", "model.width=big"], ["model.width='big'", "mymodels.TinyLM's width"]),
        (["model._target_=torch.nn.Linear", "model.in_features=big", "model.out_features=2"], ["in_features is int"]),
        (["model=llama_tiny", "model.layer=3"], ["model.layer", "(did you mean 'layers'?)"]),
    ],
)
def test_value_of_another_type_names_key_value_and_type(overrides, words):
    """NOTE [argument types]: checked when the config is read, before any model is built
    (``model.embed=big`` reached torch.empty inside the workers)."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_values_the_target_takes_pass():
    """An int where a float is declared, a null, a list for a tuple, and every shipped
    model's node as shipped, build."""
    cfg = load_config(["model=llama_tiny", "model.rope_theta=10000", "model.head_dim=null"])
    assert cfg.model.llama().rope_theta == 10000
    for name in ("llama_tiny", "gpt2_tiny", "vlm_tiny"):
        assert next(build_model(load_config([f"model={name}"]).model).parameters()).is_meta
    for name in ("llama_small", "llama_1b", "llama3_8b", "llama3_70b", "llama3_405b", "gpt2", "vlm", "vlm_small"):
        load_config([f"model={name}"])
    load_config(["model=vlm_tiny", "model.pixel_mean=[0.5,0.5,0.5]", "model.pixel_std=[1,1,1]"])


def test_argument_types_from_annotations_and_defaults():
    """What a target declares, read from PEP 563 strings (this module's annotations are
    strings), with an unreadable annotation left unchecked, and from number defaults."""
    from meshlm.core.arg_types import check_value, parameter_types

    def target(a: int, b: float = 1.0, c: Optional[int] = None, d: bool = False, e=3, f="x", g: Unknown = 1, h=None,
               i: "list[int] | None" = None, j: Literal["x", "y"] = "x", **kw):  # fmt: skip
        pass

    declared = parameter_types(target, inspect.signature(target))

    def bad(k, v):
        with pytest.raises(ConfigError) as e:
            check_value(f"model.{k}", v, *declared[k], owner="target")
        return str(e.value)

    for k, v in [("a", 3), ("b", 2), ("b", 2.5), ("c", None), ("c", 4), ("d", True), ("e", 2.5), ("f", 5), ("g", "s"),
                 ("h", "anything"), ("i", [1, 2]), ("i", None), ("j", "y"), ("a", None)]:  # fmt: skip
        check_value(f"model.{k}", v, *declared[k])
    assert "model.a='3' is not an integer (target's a is int); give model.a an integer" in bad("a", "3")
    assert "is not an integer" in bad("a", True)  # a bool is no int here
    assert "is not a number" in bad("b", "1e-3x")
    assert "is not an integer (or null)" in bad("c", 1.5)
    assert "is not true or false" in bad("d", "yes")
    assert "unannotated with the default 3" in bad("e", "big")
    assert "is not a list of integers (or null)" in bad("i", [1, "x"])
    assert "one of 'x', 'y'" in bad("j", "z")


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
    from meshlm.app.cli import main

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
    from meshlm.app.show import layout_rows

    with pytest.raises(AnnotationError, match="scale"):
        layout_rows(ModelConfig(target="mymodels.Unannotated"), "fsdp", "fsdp=2")
