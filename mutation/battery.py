"""The multi-process checks ``mutation/fast.py`` runs against each mutant (docs/mutation.md):
parity of training against one device (``check_training``: SGD, two steps of two
accumulated micro-batches, the loss, the gradient the optimizer steps with, parameters and
optimizer state) under the layouts that exercise each part of the core, mixed precision,
the overlapped reduction and prefetch, a pipeline, and the collective budgets of ``tests/dist/
test_budget.py``.  Cheapest first; a mutant is killed by the first that fails.

Each entry is (name, world size, function, args, kwargs); the functions run on every rank
of a ``DistPool`` of that size and raise (or return a non-empty message) on a mismatch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests" / "dist"


def parity(layout: str, mesh: str, **kw):
    from harness.parity import check_training

    kw.setdefault("optims", ("sgd",))
    kw.setdefault("steps", 2)
    check_training(layout, mesh, **kw)


def pipeline_parity(layout: str, mesh: str, schedule: str, v: int):
    from harness.parity import LlamaBuild, check_training

    check_training(
        layout,
        mesh,
        build=LlamaBuild("llama_tiny", (("layers", 4),)),
        optims=("sgd",),
        steps=2,
        schedule=schedule,
        stages_per_rank=v,
    )


def _tests_module(name: str):
    """A module of tests/dist, imported by name."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return __import__(name)


def budget(layout: str, mesh: dict):
    """The step's collectives equal tests/dist/test_budget.py's budget."""
    test_budget = _tests_module("test_budget")
    diff = test_budget._diff(test_budget._count_step(layout, mesh), test_budget.budget(layout, mesh))
    if diff:
        raise AssertionError(f"budget of {layout} {mesh}: {diff}")


def budget_prefetching(layout: str, mesh: dict):
    """tests/dist/test_budget.py::test_budget_with_prefetch: with overlap, every block's
    gather but the first is prefetched and used, and the collectives are still the budget."""
    t = _tests_module("test_budget")
    counts, stats = t._count_step_prefetching(layout, mesh)
    diff = t._diff(counts, t.budget(layout, mesh))
    if diff:
        raise AssertionError(f"budget of {layout} {mesh} with prefetch: {diff}")
    if stats != {"issued": 2, "used": 2, "stale": 0}:  # llama_tiny's 2 blocks, forward and recompute
        raise AssertionError(f"prefetch stats {stats}")


def grad_norm_and_clip():
    """tests/dist/test_mixed_precision.py's norm and clip checks: the global norm is the
    one-device norm, reduced over the mesh's groups; clipping scales to max_norm."""
    t = _tests_module("test_mixed_precision")
    t._check_norm(*t._norm_job())
    t._check_clip(*t._clip_job())


def whole_tensor_step(layout: str, mesh: str):
    """tests/dist/test_optim_whole.py: Adafactor steps as on one device."""
    bad = _tests_module("test_optim_whole")._job(layout, mesh, "adafactor")
    assert not bad, bad


def real_model(layout: str, mesh: str, model: str, root_per_rank: bool = True):
    """tests/dist/test_real_models.py: a model meshlm did not write (``branchy``: a branch
    unused on some steps and ranks, uneven counted targets; ``masked``: the same with a
    hand-written masked mean; ``moe``: an expert no token reaches) against plain torch."""
    t = _tests_module("test_real_models")
    build = {"branchy": t.build_branchy, "masked": t.build_masked, "moe": t.build_moe}[model]
    batches = t.moe_batches if model == "moe" else t.Gated(root_per_rank)
    parity(layout, mesh, build=build, batches=batches, from_seed=False)


BATTERY = [
    ("whole-tensor step fsdp fsdp=2", 2, whole_tensor_step, ("fsdp", "fsdp=2"), {}),
    ("grad norm and clip fsdp_tp fsdp=2,tp=2", 4, grad_norm_and_clip, (), {}),
    ("real model ddp dp=2", 2, real_model, ("ddp", "dp=2", "branchy"), {}),
    ("real model moe zero2 dp=2", 2, real_model, ("zero2", "dp=2", "moe"), {}),
    ("real model masked mean fsdp fsdp=2", 2, real_model, ("fsdp", "fsdp=2", "masked", False), {}),
    ("real model tp tp=2", 2, real_model, ("tp", "tp=2", "branchy"), {}),
    ("parity ddp dp=2", 2, parity, ("ddp", "dp=2"), {}),
    ("parity zero1 dp=2", 2, parity, ("zero1", "dp=2"), {}),
    ("parity zero2 fsdp=2", 2, parity, ("zero2", "fsdp=2"), {}),
    ("parity fsdp fsdp=2", 2, parity, ("fsdp", "fsdp=2"), {}),
    ("parity tp tp=2", 2, parity, ("tp", "tp=2"), {}),
    ("parity tp_sp tp=2", 2, parity, ("tp_sp", "tp=2"), {}),
    ("parity single dp=2", 2, parity, ("single", "dp=2"), {}),
    ("parity zero2 dp=2 overlapped", 2, parity, ("zero2", "dp=2"), {"overlap": True}),
    ("parity fsdp fsdp=2 overlapped", 2, parity, ("fsdp", "fsdp=2"), {"overlap": True}),
    ("parity zero1 dp=2 bf16", 2, parity, ("zero1", "dp=2"), {"precision": "bf16"}),
    ("parity zero2 dp=2 bf16", 2, parity, ("zero2", "dp=2"), {"precision": "bf16"}),
    ("parity fsdp fsdp=2 bf16", 2, parity, ("fsdp", "fsdp=2"), {"precision": "bf16"}),
    ("parity pp pp=2 1f1b", 2, pipeline_parity, ("pp", "pp=2", "1f1b", 1), {}),
    ("parity hsdp dp=2,fsdp=2", 4, parity, ("hsdp", "dp=2,fsdp=2"), {}),
    ("parity fsdp_tp_sp fsdp=2,tp=2", 4, parity, ("fsdp_tp_sp", "fsdp=2,tp=2"), {}),
    ("parity fsdp_pp fsdp=2,pp=2 zbv", 4, pipeline_parity, ("fsdp_pp", "fsdp=2,pp=2", "zbv", 2), {}),
    ("budget fsdp fsdp=4", 4, budget, ("fsdp", {"fsdp": 4}), {}),
    ("budget zero1 dp=4", 4, budget, ("zero1", {"dp": 4}), {}),
    ("budget fsdp_tp_sp fsdp=2,tp=2", 4, budget, ("fsdp_tp_sp", {"fsdp": 2, "tp": 2}), {}),
    ("budget fsdp fsdp=4 prefetching", 4, budget_prefetching, ("fsdp", {"fsdp": 4}), {}),
]


def run_with(mutant: str, fn, args, kwargs):
    """``fn(*args, **kwargs)`` with ``mutant`` active (mutmut's trampolines read the
    environment at every call), then none."""
    os.environ["MUTANT_UNDER_TEST"] = mutant
    try:
        return fn(*args, **kwargs)
    finally:
        os.environ["MUTANT_UNDER_TEST"] = ""
