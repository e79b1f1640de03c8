"""Dropout across a resume at another world size (NOTE [dropout keys] in meshlm/core/rng.py):
``meshlm train`` with ``model.dropout=0.1`` checkpointed under fsdp on 2 processes and
resumed under ``single`` on 1, and the other way round, continues the uninterrupted run's
loss curve: the masks are a function of (seed, step, global row, position, layer), not of a
generator state the checkpoint restores only at the same world size.

The workers call ``meshlm.app.train.run`` (the loop ``meshlm train`` runs) on module-scoped
pools.  Tolerance: NOTE [invariance tolerance] in tests/harness/tolerances.py (the runs
differ by the fp32 reduction order of fsdp against one process, fed back through a few
AdamW steps); other masks after the resume move the loss by far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from meshlm.app.config import RunConfig, from_dict, load_config
from harness import dist_pool_fixture
from harness import tolerances as tol

STEPS, SAVED = 5, 2  # the checkpoint of step 2 resumes for steps 3..5

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)


def _cfg(layout: str, mesh: dict, train: dict, ck: Path, resume: str | None = None) -> RunConfig:
    model = load_config(["model=llama_tiny"]).model.to_dict()
    model["dropout"] = 0.1
    t = {
        "steps": STEPS,
        "batch_size": 8,
        "seq_len": 32,
        "lr": 3e-3,
        "min_lr": 3e-3,
        "warmup_steps": 2,
        "val_every": 0,
        "val_batches": 1,
        "progress": False,
        "count_comm": False,
        "pg_timeout_s": 60,
        **train,
    }
    return from_dict(
        {
            "model": model,
            "layout": {"name": layout},
            "mesh": mesh,
            "train": t,
            "checkpoint": {"dir": str(ck), "every": SAVED, "resume": resume},
        }
    )


def _losses(cfg: RunConfig, run_dir: str) -> dict[int, float]:
    """The run's loss per step (metrics.jsonl of rank 0's run dir)."""
    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _same(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps), got
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst <= tol.INVARIANCE_RTOL, (worst, got, want)


CASES = [
    ("fsdp", {"fsdp": 2}, 1, {"activation_checkpointing": "full"}),
    ("pp", {"pp": 2}, 2, {}),
]


@pytest.mark.parametrize("layout,mesh,grad_accum,two_train", CASES, ids=["fsdp2-checkpointed", "pp2-grad_accum2"])
def test_dropout_resume_at_another_world_size(pool1, pool2, tmp_path, layout, mesh, grad_accum, two_train):
    """Single on 1 process uninterrupted; ``layout`` on 2; each resumed from the other's
    checkpoint of step 2.  fsdp recomputes its blocks in backward (the recompute redraws the
    forward's keys); pp: the pipeline's micro-batches start from the same generator states
    as plain gradient accumulation's."""
    single = ("single", {"dp": 1}, {"grad_accum": grad_accum})
    two = (layout, mesh, {"grad_accum": grad_accum, **two_train})
    a = pool1.run(_losses, _cfg(*single, tmp_path / "ck_single"), str(tmp_path / "single"))[0]
    b = pool2.run(_losses, _cfg(*two, tmp_path / "ck_two"), str(tmp_path / "two"))[0]
    _same(b, a, range(1, STEPS + 1))  # the same masks under both layouts (no resume yet)

    saved = f"step_{SAVED:08d}"
    # 2 processes -> single on 1
    c = pool1.run(_losses, _cfg(*single, tmp_path / "ck_c", str(tmp_path / "ck_two" / saved)), str(tmp_path / "c"))[0]
    _same(c, a, range(SAVED + 1, STEPS + 1))
    # single on 1 process -> 2
    d = pool2.run(_losses, _cfg(*two, tmp_path / "ck_d", str(tmp_path / "ck_single" / saved)), str(tmp_path / "d"))[0]
    _same(d, a, range(SAVED + 1, STEPS + 1))
