"""README.md's "A model and a layout" runs as written: its model, its layout YAML and its
sharding snippet, on 4 gloo processes (the mesh it names, fsdp=2 x tp=2). The one AdamW step
it takes leaves the weights that the same step takes on the same model in plain torch on one
process, and the layout places the weights as the README says."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

import meshlm
from harness import dist_pool_fixture

README = Path(__file__).resolve().parents[2] / "README.md"
pool4 = dist_pool_fixture(4, timeout_s=60)


def _section() -> dict[str, list[str]]:
    text = README.read_text()
    part = text[text.index("## A model and a layout") : text.index("## What it does")]
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", part, re.S):
        blocks.setdefault(lang, []).append(body)
    return blocks


def _layout_file(blocks: dict[str, list[str]], where: Path) -> Path:
    """The YAML block, written where its first line (`# <name>`) says the snippet loads it from."""
    [yaml_text] = blocks["yaml"]
    name = yaml_text.splitlines()[0].removeprefix("# ").strip()
    path = where / name
    path.write_text(yaml_text)
    return path


def _sharded_step(where: str) -> dict[str, torch.Tensor]:
    """On each worker: the README's model and snippet in one namespace, from `where`."""
    blocks = _section()
    model_code, snippet = blocks["python"]
    os.chdir(where)
    ns: dict = {}
    exec(compile(model_code + "\n" + snippet, str(README), "exec"), ns)
    return {k: v.clone() for k, v in meshlm.full_state_dict(ns["model"]).items()}


def _one_device_step() -> dict[str, torch.Tensor]:
    """The same step with the README's model on one process, plain torch: no layout, no mesh."""
    ns: dict = {}
    exec(compile(_section()["python"][0], str(README), "exec"), ns)
    model = ns["MLP"](64, 256)
    meshlm.init_params(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    model(x, y).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_the_readme_example_trains_as_one_device(pool4, tmp_path):
    blocks = _section()
    assert len(blocks["python"]) == 2 and "meshlm.shard(" in blocks["python"][1]
    _layout_file(blocks, tmp_path)
    got = pool4.run(_sharded_step, str(tmp_path))
    want = _one_device_step()
    for rank, weights in enumerate(got):
        assert sorted(weights) == sorted(want)
        for k in want:
            # fp32 sums in another order; AdamW's first step moves each weight by about lr = 1e-3
            torch.testing.assert_close(weights[k], want[k], rtol=0, atol=1e-6, msg=f"rank {rank}: {k}")


def test_the_readme_layout_places_the_weights_as_it_says(tmp_path):
    """Under the README's layout on fsdp=2 x tp=2: `mlp` split over tp where stored and where
    used, `embed` split over fsdp where stored and gathered for use."""
    from meshlm.runtime.lowering.params import plan_params

    blocks = _section()
    layout = meshlm.load_layout(_layout_file(blocks, tmp_path))
    ns: dict = {}
    exec(compile(blocks["python"][0], str(README), "exec"), ns)
    plans = plan_params(ns["MLP"](64, 256, device="meta"), layout, {"fsdp": 2, "tp": 2})
    w_in = plans["w_in"]  # ("mlp", "embed")
    assert w_in.storage == (("tp",), ("fsdp",)) and w_in.compute == (("tp",), ())
