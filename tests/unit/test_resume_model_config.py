"""Which model config a resumed run builds (meshlm/train/lifecycle.py ``model_config``): the
checkpoint's architecture, and a line saying so only when it differs from the run's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from meshlm.models.llama import llama_fields
from meshlm.models.node import ModelConfig
from meshlm.train import lifecycle

# as Hydra reads it (YAML 1.1 alone reads 1e-05 as a string)
TINY = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[2] / "conf/model/llama_tiny.yaml"))


def _resume(tmp_path, monkeypatch, saved: dict, capsys):
    (tmp_path / "meta.json").write_text(json.dumps({"model": {"class": "Llama", "config": saved}}))
    monkeypatch.setattr(lifecycle, "resume_path", lambda cfg: str(tmp_path))
    args = {k: v for k, v in TINY.items() if k not in ("_target_", "name")}
    mcfg = ModelConfig(target=TINY["_target_"], name="llama_tiny", args=args)
    got = lifecycle.model_config(SimpleNamespace(), mcfg)
    return mcfg, got, capsys.readouterr().out


def test_a_checkpoint_of_the_same_model_resumes_it_without_a_line(tmp_path, monkeypatch, capsys):
    # the checkpoint records every field, the node only those its YAML names (qk_norm,
    # qkv_bias ... at their defaults): the same model
    args = {k: v for k, v in TINY.items() if k not in ("_target_", "name")}
    saved = dataclasses.asdict(llama_fields(**args))
    assert set(saved) > set(args)  # what makes the case: fields the node leaves out
    mcfg, got, out = _resume(tmp_path, monkeypatch, saved, capsys)
    assert got == mcfg and out == ""


def test_a_checkpoint_of_another_shape_says_which_fields_it_takes(tmp_path, monkeypatch, capsys):
    args = {k: v for k, v in TINY.items() if k not in ("_target_", "name")}
    saved = dataclasses.asdict(llama_fields(**{**args, "embed": 32, "qk_norm": True}))
    _mcfg, got, out = _resume(tmp_path, monkeypatch, saved, capsys)
    assert got.args["embed"] == 32 and got.args["qk_norm"] is True
    assert "model config from the checkpoint resumed" in out
    assert "embed=32" in out and "qk_norm=True" in out and "qkv_bias" not in out and "layers" not in out
