"""Layout invariance of the whole training loop: the same config and seed under ddp, zero1,
zero2, fsdp, tp_sp and fsdp_tp on 4 gloo processes, and on one process, give the same loss
curve and the same gradient-norm curve (``grad_norm`` in metrics.jsonl: the global norm of
the gradient the optimizer steps with, before clipping).  Gradient accumulation is checked
on both: clipping and AdamW hide a gradient's scale from the loss curve, not from its norm.

The workers call ``meshlm.app.train.run`` (the loop ``meshlm train`` runs) on a module-scoped
pool, so the 4-process runs share one process group.

Tolerances: NOTE [invariance tolerance] in tests/harness/tolerances.py.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from meshlm.app.config import RunConfig, from_dict, load_config
from harness import dist_pool_fixture
from harness import tolerances as tol

STEPS = 12  # INVARIANCE_RTOL and INVARIANCE_NORM_RTOL are derived for 12 steps
INVARIANCE_RTOL, NORM_RTOL = tol.INVARIANCE_RTOL, tol.INVARIANCE_NORM_RTOL
FIRST_STEP_RTOL = tol.LOSS_RTOL  # step 1 is one forward on identical weights
FIRST_NORM_RTOL = tol.FIRST_NORM_RTOL

pool4 = dist_pool_fixture(4, timeout_s=60)

CASES = [("ddp", {"dp": 4}), ("zero1", {"dp": 4}), ("zero2", {"dp": 4}), ("fsdp", {"fsdp": 4}), ("tp_sp", {"tp": 4}),
         ("fsdp_tp", {"fsdp": 2, "tp": 2})]


def _cfg(layout: str, mesh: dict, **train) -> RunConfig:
    # min_lr = lr: a constant LR after warmup, so a shorter run follows the reference's first steps.
    t = {"steps": STEPS, "batch_size": 8, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 2,
         "val_every": 0, "val_batches": 1, "progress": False, "count_comm": False, "pg_timeout_s": 60}
    t.update(train)
    return from_dict({"model": load_config(["model=llama_tiny"]).model.to_dict(), "layout": {"name": layout}, "mesh": mesh, "train": t})


def _curves(cfg: RunConfig, run_dir: str) -> dict[str, list[float]]:
    """The run's loss and grad_norm per step (metrics.jsonl of rank 0's run dir)."""
    import json
    from pathlib import Path

    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    with open(Path(run_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}


def _one_process(cfg: RunConfig, run_dir: str) -> dict[str, list[float]]:
    try:
        return _curves(cfg, run_dir)
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


def _same_curves(got: dict, ref: dict, steps: int) -> None:
    """Loss and grad_norm curves of ``steps`` steps against the reference's first ones, step
    1 to the one-step tolerances, every step to NOTE [invariance tolerance]."""
    loss, norm = got["loss"], got["grad_norm"]
    assert len(loss) == len(norm) == steps and all(math.isfinite(x) for x in loss + norm), got
    assert abs(loss[0] - ref["loss"][0]) <= FIRST_STEP_RTOL * abs(ref["loss"][0]), (loss[0], ref["loss"][0])
    assert abs(norm[0] - ref["grad_norm"][0]) <= FIRST_NORM_RTOL * ref["grad_norm"][0], (norm[0], ref["grad_norm"][0])
    assert _close(loss, ref["loss"][:steps]) <= INVARIANCE_RTOL, (loss, ref["loss"])
    assert _close(norm, ref["grad_norm"][:steps]) <= NORM_RTOL, (norm, ref["grad_norm"])


@pytest.mark.parametrize("layout,mesh", CASES, ids=[c[0] for c in CASES])
def test_curves_match_one_process(pool4, reference, tmp_path, layout, mesh):
    got = pool4.run(_curves, _cfg(layout, mesh), str(tmp_path))[0]
    _same_curves(got, reference, STEPS)
    assert got["loss"][-1] < got["loss"][0] - 0.1, "loss did not fall"


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_same_curve(pool4, reference, tmp_path, ac):
    """Recomputing blocks in backward changes no value: the curves are the reference's."""
    # fsdp: the blocks already re-gather parameters under the lowering's own selective
    # checkpoint, so this also checks that the two nest.
    cfg = _cfg("fsdp", {"fsdp": 4}, steps=4, activation_checkpointing=ac)
    _same_curves(pool4.run(_curves, cfg, str(tmp_path))[0], reference, 4)


@pytest.mark.parametrize("layout", ["ddp", "zero1"])
def test_grad_accum_same_curves(pool4, reference, tmp_path, layout):
    """Two micro-batches of 4 = one batch of 8: the mean of the two halves' mean losses
    equals the full batch's mean (equal halves), and so do the gradients, so the loss and
    gradient-norm curves are the reference's (a missing 1/grad_accum doubles the norm)."""
    cfg = _cfg(layout, {"dp": 4}, steps=4, batch_size=8, grad_accum=2)
    # With 2 micro-batches the loader takes windows in the same order, 4 at a time.
    _same_curves(pool4.run(_curves, cfg, str(tmp_path))[0], reference, 4)
