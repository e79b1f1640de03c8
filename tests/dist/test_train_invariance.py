"""Layout invariance of the whole training loop: the same config and seed under ddp, zero2,
fsdp, tp_sp and fsdp_tp on 4 gloo processes, and on one process, give the same loss curve.

The workers call ``meshlm.train.run`` (the loop ``meshlm train`` runs) on a module-scoped
pool, so the 4-process runs share one process group.

NOTE [invariance tolerance]
    Each step's loss differs between layouts only by the order of fp32 additions (see
    meshlm/testing/tolerances.py: ~1e-6 relative per reduction, bounded there by
    LOSS_RTOL = 1e-5 for one step).  Over training these differences feed back through
    the weights: AdamW's update m/sqrt(v) is O(lr) per element whatever the gradient's size,
    so a rounding-level gradient difference moves each weight by at most ~lr·(relative
    gradient error) per step, and the loss after k steps differs by about k times one step's
    error.  For 12 steps at lr 3e-3 that is ~12 x 1e-5 = 1.2e-4 relative; we allow 3e-4
    (loss ~5, i.e. 1.5e-3 absolute).  A real bug (a wrong shard, a missing reduction, a
    batch fed to the wrong rank) changes the loss at step 1 by >1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from meshlm.config import RunConfig, from_dict
from meshlm.testing import dist_pool_fixture

STEPS = 12
INVARIANCE_RTOL = 3e-4  # NOTE [invariance tolerance]
FIRST_STEP_RTOL = 1e-5  # step 1 is one forward on identical weights: LOSS_RTOL

pool4 = dist_pool_fixture(4, timeout_s=60)

CASES = [("ddp", {"dp": 4}), ("zero2", {"dp": 4}), ("fsdp", {"fsdp": 4}), ("tp_sp", {"tp": 4}),
         ("fsdp_tp", {"fsdp": 2, "tp": 2})]


def _cfg(layout: str, mesh: dict, **train) -> RunConfig:
    # min_lr = lr: a constant LR after warmup, so a shorter run follows the reference's first steps.
    t = dict(steps=STEPS, batch_size=8, seq_len=32, lr=3e-3, min_lr=3e-3, warmup_steps=2, val_every=0, val_batches=1,
             progress=False, count_comm=False, pg_timeout_s=60)
    t.update(train)
    return from_dict({"model": {"name": "llama_tiny"}, "layout": {"name": layout}, "mesh": mesh, "train": t})


def _losses(cfg: RunConfig, run_dir: str) -> list[float]:
    import json
    from pathlib import Path

    from meshlm.train import run

    run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(l) for l in open(Path(run_dir) / "metrics.jsonl")]
    return [r["loss"] for r in rows]


def _one_process(cfg: RunConfig, run_dir: str) -> list[float]:
    try:
        return _losses(cfg, run_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    import multiprocessing as mp

    # In a fresh process: the one-process run initialises its own (world 1) process group.
    with mp.get_context("spawn").Pool(1) as p:
        return p.apply(_one_process, (_cfg("single", {"dp": 1}), str(d)))


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout,mesh", CASES, ids=[c[0] for c in CASES])
def test_loss_curve_matches_one_process(pool4, reference, tmp_path, layout, mesh):
    res = pool4.run(_losses, _cfg(layout, mesh), str(tmp_path))
    curve = res[0]
    assert len(curve) == STEPS and all(math.isfinite(x) for x in curve)
    assert abs(curve[0] - reference[0]) <= FIRST_STEP_RTOL * abs(reference[0])
    assert _close(curve, reference) <= INVARIANCE_RTOL, (curve, reference)
    assert curve[-1] < curve[0] - 0.1, "loss did not fall"


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_same_curve(pool4, reference, tmp_path, ac):
    """Recomputing blocks in backward changes no value: the curve is the reference's."""
    # fsdp: the blocks already re-gather parameters under the lowering's own selective
    # checkpoint, so this also checks that the two nest.
    cfg = _cfg("fsdp", {"fsdp": 4}, steps=4, activation_checkpointing=ac)
    curve = pool4.run(_losses, cfg, str(tmp_path))[0]
    assert _close(curve, reference[:4]) <= INVARIANCE_RTOL


def test_grad_accum_same_curve(pool4, reference, tmp_path):
    """Two micro-batches of 4 = one batch of 8: the mean of the two halves' mean losses
    equals the full batch's mean (equal halves), and so do the gradients."""
    cfg = _cfg("ddp", {"dp": 4}, steps=4, batch_size=8, grad_accum=2)
    # With 2 micro-batches the loader takes windows in the same order, 4 at a time.
    curve = pool4.run(_losses, cfg, str(tmp_path))[0]
    assert _close(curve, reference[:4]) <= INVARIANCE_RTOL
