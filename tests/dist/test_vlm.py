"""The vision-language model (meshlm.models.VLM) under scoped layouts (NOTE [scoped layouts]
in meshlm/core/scopes.py) and whole-model ones, on 4 gloo processes:

- parity with one device (loss, the gradients the optimizer steps with, parameters and
  optimizer state over three steps of two micro-batches, two steps where SGD alone runs;
  harness.parity) under the
  shipped vlm_fsdp_tp, with the encoder switched to replicated, tensor parallel or inline
  rules by its scope's line alone, and under whole-model fsdp and fsdp_tp;
- a batch in which whole ranks hold text-only rows finishes, with correct gradients (the
  shipped layout's case);
- a checkpoint saved under one scoped layout loads under another (every parameter and
  optimizer state exactly, the next losses as the run that never resharded).
Logits against transformers' LLaVA under layouts: tests/dist/test_hf_llava_layouts.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from harness import dist_pool_fixture
from harness.parity import VlmBatches as Batches
from harness.parity import VlmBuild as Build
from harness.parity import assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=90)
MESH = "fsdp=2,tp=2"
INPUT_AXES = {2: ("batch", "channels", None, None)}
TEXT_ROWS = (1, 6)  # text-only rows (zero images) among the image rows


_ok = assert_parity


def _scoped(tmp_path, vision: str) -> str:
    """vlm_fsdp_tp with its `vision:` line replaced: the only change a user makes."""
    from meshlm.layout.rules import load_layout

    text = open(load_layout("vlm_fsdp_tp").source).read()
    assert "  vision: fsdp\n" in text
    p = tmp_path / f"vlm_{abs(hash(vision))}.yaml"
    p.write_text(text.replace("  vision: fsdp\n", f"  vision: {vision}\n"))
    return str(p)


def test_vlm_scoped_layout_matches_one_device_sgd_and_adamw(pool4):
    """Rows 0-3 (the first fsdp rank's half of the batch) carry no image: that rank's
    encoder still runs, its collectives meet the other rank's, and the gradients match."""
    _ok(pool4.run(check_training, "vlm_fsdp_tp", MESH, build=Build(), batches=Batches(text_rows=(0, 1, 2, 3)),
                  input_axes=INPUT_AXES))


@pytest.mark.parametrize("vision", ["ddp", "fsdp_tp", "{params: {embed: fsdp}, compute: {batch: fsdp}}"])
def test_vlm_encoder_strategy_is_one_yaml_line(pool4, tmp_path, vision):
    _ok(pool4.run(check_training, _scoped(tmp_path, vision), MESH, build=Build(), batches=Batches(TEXT_ROWS),
                  input_axes=INPUT_AXES, optims=("sgd",), steps=2))


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_vlm_whole_model_layouts_match_one_device(pool4, layout):
    mesh = "fsdp=4" if layout == "fsdp" else MESH
    _ok(pool4.run(check_training, layout, mesh, build=Build(), batches=Batches(TEXT_ROWS), input_axes=INPUT_AXES,
                  optims=("sgd",), steps=2))


def _reshard_job(layout: str, load_from, save_to, steps_before: int, steps_after: int):
    import meshlm
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint
    from meshlm.runtime.lowering import full_state_dict
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(MESH)
    model = meshlm.shard(Build()("meta", 0), layout, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    batches = [Batches(TEXT_ROWS)(k, 0)[0] for k in range(4)]  # steps 0-1 before the save, 2-3 after

    def train(bs):
        out = []
        for t, y, im in bs:
            loss = model(*(meshlm.shard_batch(v, layout, mesh, axes) for v, axes in
                           ((t, ("batch", "seq")), (y, ("batch", "seq")), (im, INPUT_AXES[2]))))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss))
        return out

    step = 0
    if load_from is None:
        train(batches[:steps_before])
        step = steps_before
    else:
        step = load_checkpoint(load_from, model=model, optimizer=opt)["step"]
    state = {k: v.clone() for k, v in full_state_dict(model).items()}
    for fqn, m in opt.masters().items():
        for k, v in opt.inner.state.get(m, {}).items():
            state[f"optim/{fqn}/{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    path = save_checkpoint(save_to, step, model=model, optimizer=opt, extra={"step": step}) if save_to else None
    return {"state": state, "after": train(batches[step : step + steps_after]), "path": path}


def test_vlm_checkpoint_moves_between_scoped_layouts(pool4, tmp_path):
    """Saved with the encoder under fsdp (vlm_fsdp_tp), loaded with it tensor parallel."""
    a = pool4.run(_reshard_job, "vlm_fsdp_tp", None, str(tmp_path / "a"), 2, 2)[0]
    b = pool4.run(_reshard_job, _scoped(tmp_path, "fsdp_tp"), a["path"], None, 0, 2)[0]
    assert sorted(b["state"]) == sorted(a["state"])
    for k, v in a["state"].items():
        torch.testing.assert_close(b["state"][k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    # another layout: other reduction orders, fp32 rounding only (as tests/dist/test_checkpoint_reshard.py)
    torch.testing.assert_close(torch.tensor(b["after"]), torch.tensor(a["after"]), rtol=1e-5, atol=1e-5)


def test_vlm_compiled_blocks_match_one_device(pool4):
    """Encoder and decoder blocks compiled (aot_eager): two block classes whose activations
    differ in length (17 patches, 24 tokens) each get a static graph (NOTE [static block
    shapes] in meshlm/runtime/compile.py; a symbolic length failed in DTensor's view rules)."""
    _ok(pool4.run(check_training, "vlm_fsdp_tp", MESH, build=Build(), batches=Batches(TEXT_ROWS), input_axes=INPUT_AXES,
                  optims=("sgd",), steps=2, compile="aot_eager"))
