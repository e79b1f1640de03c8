"""``meshlm train`` with any optimizer, parameter groups and a schedule: the loop
(``meshlm.app.train.run``) on 2 gloo processes, interrupted at a checkpoint and resumed,
continues exactly as the run that never stopped (the same losses, bit for bit, and the
same weights at the end); the rates it logs are the schedule's; the groups in the
checkpointed optimizer state are the no-decay rule's.  One case each: torch's SGD, AdamW
with no-decay groups, Adafactor (stepped whole), and a user's optimizer class
(tests/usermodel/mymodels/optim.py).  The command itself runs once, with ``optim=sgd``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import dist_pool_fixture
from meshlm.app.config import RunConfig, load_config

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

STEPS, SAVED = 5, 2
pool2 = dist_pool_fixture(2, timeout_s=90)
TINY = [
    "model=llama_tiny",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.val_every=0",
    "train.val_batches=1",
    "train.progress=false",
    "train.count_comm=false",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
]

CASES = {
    "sgd-wsd-fsdp": ["optim=sgd", "train.lr=0.05", "train.schedule=wsd", "train.decay_frac=0.4", "layout=fsdp",
                     "mesh=fsdp2"],
    "adamw-groups-linear-zero1": ["optim=adamw", "optim.no_decay=[axes:embed]", "train.schedule=linear",
                                  "layout=zero1", "mesh=dp2"],
    "adafactor-constant-tp": ["optim=adafactor", "train.schedule=constant", "layout=tp", "mesh=tp2"],
    "user-cosine-zero2": ["optim._target_=mymodels.optim.SignMomentum", "optim.beta=0.8", "train.lr=1e-3",
                          "layout=zero2", "mesh=dp2"],
}  # fmt: skip


def _run(cfg: RunConfig, run_dir: str) -> dict:
    """The run's metrics rows and, after it, every parameter gathered (rank 0's copy)."""
    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows}


def _cfg(over: list[str], ck: Path, resume: str | None = None) -> RunConfig:
    extra = [f"checkpoint.dir={ck}", f"checkpoint.every={SAVED}"] + ([f"checkpoint.resume={resume}"] if resume else [])
    return load_config([*TINY, *over, *extra])


def _weights(ck: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint, read by torch's own DCP converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ck.name}.pt"
    dcp_to_torch_save(str(ck / f"step_{STEPS:08d}"), str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_continues_exactly(pool2, tmp_path, name):
    from meshlm.train.schedule import lr_at

    over = CASES[name]
    cfg = _cfg(over, tmp_path / "ck_a")
    a = pool2.run(_run, cfg, str(tmp_path / "a"))[0]["rows"]
    pool2.run(_run, _cfg(over, tmp_path / "ck_b"), str(tmp_path / "b0"))  # same, to be cut at step 2
    b = pool2.run(
        _run, _cfg(over, tmp_path / "ck_c", str(tmp_path / "ck_b" / f"step_{SAVED:08d}")), str(tmp_path / "b")
    )
    b = b[0]["rows"]
    assert [r["step"] for r in b] == list(range(SAVED + 1, STEPS + 1))
    assert [r["loss"] for r in b] == [r["loss"] for r in a][SAVED:], name
    assert [r["lr"] for r in a] == pytest.approx([lr_at(s, cfg.train) for s in range(1, STEPS + 1)])
    wa, wb = _weights(tmp_path / "ck_a", tmp_path), _weights(tmp_path / "ck_c", tmp_path)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    assert a[-1]["loss"] < a[0]["loss"], [r["loss"] for r in a]


def test_no_decay_groups_are_in_the_checkpointed_optimizer(pool2, tmp_path):
    """The AdamW case's saved param groups: weight decay 0 for exactly the norm weights."""
    over = CASES["adamw-groups-linear-zero1"]
    pool2.run(_run, _cfg(over, tmp_path / "ck"), str(tmp_path / "a"))
    groups = torch.load(tmp_path / "ck" / f"step_{STEPS:08d}" / "extra.pt", weights_only=True)["param_groups"]
    off = sorted(n for g in groups if g["weight_decay"] == 0.0 for n in g["params"])
    on = sorted(n for g in groups if g["weight_decay"] == 0.1 for n in g["params"])
    model = load_config(["model=llama_tiny"]).model
    from meshlm.app.model_build import build_model

    plain = dict(build_model(model, device="meta").named_parameters())
    assert off == sorted(n for n, p in plain.items() if p.ndim == 1) and off
    assert on == sorted(n for n, p in plain.items() if p.ndim > 1)


def test_train_command_with_optim_sgd(tmp_path, capfd):
    """On one device, in this process (``in_process``): the optimizer group reaches the
    command's config and the run; the command's own processes are tests/dist/test_train_cli.py's."""
    from test_train_cli import in_process

    code, err = in_process(capfd, "train", *TINY, "optim=sgd", "train.lr=0.05", "layout=single", "mesh=cpu1",
                           "train.steps=3", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert code == 0, err[-2000:]
    saved = (tmp_path / "config.yaml").read_text()
    assert "_target_: torch.optim.SGD" in saved and "momentum: 0.9" in saved
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
