"""One command grammar (NOTE [one grammar] in meshlm/app/grammar.py): the same ``layout=tp
mesh=tp2`` spelling and Hydra's own flags for train, plan, generate and serve."""

from __future__ import annotations

import pytest
import yaml

from meshlm.app.cli import main
from meshlm.app.config import load_config
from meshlm.app.grammar import inference_argv, sweep
from meshlm.core.errors import ConfigError

SPELLING = ["layout=tp", "mesh=tp2"]


def _out(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_one_mesh_spelling_for_all_four_commands(capsys, tmp_path):
    train = load_config(SPELLING)  # what meshlm train composes
    assert (train.layout.name, str(train.mesh)) == ("tp", "tp=2")
    plan = yaml.safe_load(_out(capsys, ["plan", *SPELLING, "model=llama_tiny", "--cfg", "job"]))
    assert plan["layout"]["name"] == "tp" and plan["mesh"]["tp"] == 2
    for cmd in ("generate", "serve"):
        got = _out(capsys, [cmd, str(tmp_path), *SPELLING, "--cfg", "job"])
        assert got.splitlines()[1:] == ["layout: tp", "mesh: tp=2"], (cmd, got)
        flags = _out(capsys, [cmd, str(tmp_path), "--layout", "tp", "--mesh", "tp=2", "--cfg", "job"])
        assert flags == got  # the flags are aliases of the same thing


def test_plan_takes_a_config_dir(capsys, tmp_path):
    """``meshlm plan --config-dir DIR model=mine`` (a lexer error once) composes DIR's group."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("name: mine\nembed: 32\nheads: 4\nkv_heads: 4\nmlp: 64\n")
    cfg = yaml.safe_load(_out(capsys, ["plan", "--config-dir", str(tmp_path), "model=mine", "--cfg", "job"]))
    assert cfg["model"]["name"] == "mine" and cfg["model"]["embed"] == 32
    text = _out(capsys, ["plan", f"--config-dir={tmp_path}", "model=mine", "mesh=dp2", "layout=ddp"])
    assert "mine" in text and "run it: meshlm train" in text


def test_sweep_is_every_combination(capsys, tmp_path):
    assert sweep(["layout=tp,single", "mesh=tp2,cpu1", "x=[a,b]"], True) == [
        ["layout=tp", "mesh=tp2", "x=[a,b]"], ["layout=tp", "mesh=cpu1", "x=[a,b]"],
        ["layout=single", "mesh=tp2", "x=[a,b]"], ["layout=single", "mesh=cpu1", "x=[a,b]"],
    ]  # fmt: skip
    out = _out(capsys, ["generate", str(tmp_path), "-m", "layout=tp,single", "mesh=tp2", "--cfg", "job"])
    assert out.count("layout: tp\n") == 1 and out.count("layout: single\n") == 1


def test_model_init_from_is_the_source(tmp_path):
    _flags, [(_over, argv)] = inference_argv(["--prompt", "hi", f"model.init_from={tmp_path}"], "meshlm generate")
    assert argv == ["--prompt", "hi", str(tmp_path)]
    with pytest.raises(ConfigError, match="model=llama_tiny: the model to load is a Hugging Face directory"):
        inference_argv(["x", "model=llama_tiny"], "meshlm generate")
    with pytest.raises(ConfigError, match="--config-name is for meshlm train only"):
        inference_argv(["x", "--config-name", "other"], "meshlm generate")
