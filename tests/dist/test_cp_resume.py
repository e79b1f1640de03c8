"""Resuming across context parallel through ``meshlm train``'s loop (``meshlm.app.train.run``):
a run of a plain GPT-2 (tests/usermodel/mymodels/cp_models.py, learned positions) checkpointed
under ``fsdp_cp`` on fsdp=2 x cp=2 resumes under ``fsdp`` on 4 processes, and the other way
round, continuing the uninterrupted run's loss curve.  Parameters are stored over fsdp and
replicated over cp, so the checkpoint's shards are those of the layout without cp; the data
resumes at the same global rows whatever the layout (docs/cp.md).

Tolerance: NOTE [invariance tolerance] in tests/harness/tolerances.py (the two layouts differ
by fp32 reduction order, fed back through a few AdamW steps); a resume that restarted the
data or the optimizer, or lost the positions' order, moves the loss by far more."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from harness import dist_pool_fixture
from harness import tolerances as tol
from meshlm.app.config import RunConfig, from_dict

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

STEPS, SAVED = 4, 2  # the checkpoint of step 2 resumes for steps 3..4
MODEL = {"_target_": "mymodels.cp_models.PlainGPT2", "vocab": 256, "width": 32, "block_size": 64}
CP, FSDP = ("fsdp_cp", {"fsdp": 2, "cp": 2}), ("fsdp", {"fsdp": 4})

pool4 = dist_pool_fixture(4, timeout_s=120)


def _cfg(layout: str, mesh: dict, ck: Path, resume: str | None = None) -> RunConfig:
    t = {
        "steps": STEPS,
        "batch_size": 4,
        "seq_len": 64,
        "lr": 3e-3,
        "min_lr": 3e-3,
        "warmup_steps": 1,
        "val_every": 0,
        "val_batches": 1,
        "progress": False,
        "count_comm": False,
        "pg_timeout_s": 120,
    }
    return from_dict(
        {
            "model": MODEL,
            "layout": {"name": layout},
            "mesh": mesh,
            "train": t,
            "checkpoint": {"dir": str(ck), "every": SAVED, "resume": resume},
        }
    )


def _losses(cfg: RunConfig, run_dir: str) -> dict[int, float]:
    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _same(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps), got
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst <= tol.INVARIANCE_RTOL, (worst, got, want)


def test_resume_between_cp_and_fsdp(pool4, tmp_path):
    a = pool4.run(_losses, _cfg(*CP, tmp_path / "ck_cp"), str(tmp_path / "cp"))[0]
    b = pool4.run(_losses, _cfg(*FSDP, tmp_path / "ck_fsdp"), str(tmp_path / "fsdp"))[0]
    _same(b, a, range(1, STEPS + 1))  # the same curve under both layouts (no resume yet)
    saved = f"step_{SAVED:08d}"
    c = pool4.run(_losses, _cfg(*FSDP, tmp_path / "ck_c", str(tmp_path / "ck_cp" / saved)), str(tmp_path / "c"))[0]
    _same(c, a, range(SAVED + 1, STEPS + 1))  # fsdp_cp -> fsdp
    d = pool4.run(_losses, _cfg(*CP, tmp_path / "ck_d", str(tmp_path / "ck_fsdp" / saved)), str(tmp_path / "d"))[0]
    _same(d, b, range(SAVED + 1, STEPS + 1))  # fsdp -> fsdp_cp
