"""``meshlm train model=moe_tiny layout=fsdp_ep mesh=fsdp2_ep2`` (expert parallel on 4
processes the command starts) trains with the loss and gradient-norm curves of ``layout=fsdp
mesh=fsdp4``: the same global batches, the experts on their ep ranks, tokens sent to them by
all-to-all (docs/moe.md).  Tolerances: NOTE [invariance tolerance] in
tests/harness/tolerances.py (12 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import tolerances as tol

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "model=moe_tiny",
    "train.steps=12",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.min_lr=3e-3",
    "train.val_every=0",
    "train.val_batches=1",
    "train.progress=false",
    "train.pg_timeout_s=60",
]


def _train(tmp: Path, *args: str) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.app.cli", "train", *RUN, *args, f"hydra.run.dir={tmp}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_fsdp_ep_trains_with_the_loss_curve_of_fsdp(tmp_path):
    ep = _train(tmp_path / "ep", "layout=fsdp_ep", "mesh=fsdp2_ep2")
    ref = _train(tmp_path / "fsdp", "layout=fsdp", "mesh=fsdp4")
    assert len(ep) == len(ref) == 12
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1, "loss did not fall"
    for a, b in zip(ep, ref):
        assert abs(a["loss"] - b["loss"]) <= tol.INVARIANCE_RTOL * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= tol.INVARIANCE_NORM_RTOL * b["grad_norm"], a["step"]
