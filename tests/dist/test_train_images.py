"""``meshlm train data.format=images`` end to end through ``meshlm.app.train.run`` on 2 gloo ranks:
the shapes task written under the run directory, each rank's rows of tokens, labels and images
reaching a stand-in image-text model (``model(tokens, labels, images=...)``) sharded over the
batch, the same loss under two layouts; a pipelined layout refused naming the format.
The loader itself: tests/unit/test_data_images.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm import nn as mnn
from meshlm.app.config import RunConfig, from_dict
from meshlm.core.errors import ConfigError
from harness import dist_pool_fixture
from harness import tolerances as tol

pool2 = dist_pool_fixture(2, timeout_s=60)
STEPS = 6


class TinyVLM(nn.Module):
    """Token embedding plus a projection of each image's mean colour, a linear head."""

    input_axes = {"images": ("batch", None, None, None)}

    def __init__(self, vocab: int = 257, width: int = 32, image_size: int = 16, patch_size: int = 8, device=None):
        super().__init__()
        self.wte = mnn.Embedding(vocab, width, axes=("vocab", "embed"), init_std=0.1, device=device)
        self.proj = mnn.Linear(3, width, bias=False, axes=(None, "embed"), init_std=0.1, device=device)
        self.head = mnn.Linear(width, vocab, bias=False, axes=("embed", "vocab"), init_std=0.1, device=device)

    def forward(self, tokens, labels, images):
        x = self.wte(tokens) + self.proj(images.mean(dim=(2, 3)) * 4)[:, None, :]
        logits = meshlm.constrain(self.head(meshlm.constrain(x, ("batch", "seq", "embed"))), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)


def _cfg(layout: str, mesh: dict) -> RunConfig:
    t = {"steps": STEPS, "batch_size": 8, "seq_len": 40, "lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0,
         "val_every": 0, "val_batches": 2, "progress": False, "count_comm": False, "pg_timeout_s": 60,
         "grad_accum": 2}  # fmt: skip
    return from_dict({"model": {"_target_": f"{__name__}.TinyVLM"}, "layout": {"name": layout}, "mesh": mesh,
                      "train": t, "data": {"format": "images", "shapes_samples": 120, "val_fraction": 0.2}})  # fmt: skip


def _run(cfg: RunConfig, run_dir: str) -> dict:
    from meshlm.app.train import run

    summary = run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows], "val": rows[-1]["val_loss"], "steps": summary["steps_run"]}


def test_images_train_under_two_layouts_alike(pool2, tmp_path):
    ref = pool2.run(_run, _cfg("single", {"dp": 2}), str(tmp_path / "single"))[0]
    got = pool2.run(_run, _cfg("fsdp", {"fsdp": 2}), str(tmp_path / "fsdp"))[0]
    assert ref["steps"] == got["steps"] == STEPS
    assert got["loss"][-1] < 0.7 * got["loss"][0], got["loss"]
    assert max(abs(a - b) / b for a, b in zip(got["loss"], ref["loss"])) <= tol.INVARIANCE_RTOL, (got, ref)
    assert abs(got["val"] - ref["val"]) <= tol.INVARIANCE_RTOL * ref["val"]
    shapes = list((tmp_path / "fsdp" / "data").iterdir())
    assert len(shapes) == 1 and (shapes[0] / "captions.jsonl").is_file()  # both ranks, one copy


def test_a_pipelined_layout_is_refused_naming_the_format():
    """Refused when the config is read, before any process starts."""
    with pytest.raises(ConfigError) as e:
        _cfg("pp", {"pp": 2})
    assert "data.format=images" in str(e.value) and "layers: pp" in str(e.value), str(e.value)
