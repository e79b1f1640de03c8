"""Any optimizer, its parameter groups and a schedule keep parity with one device under every
shipped layout (harness.parity.check_training: loss, the gradient each optimizer steps with,
parameters, masters and the optimizer state, every step).

The sharded side takes its groups from meshlm's rule ``axes:embed`` (NOTE [no-decay rules]),
the reference from its own plain choice, every 1-D parameter (Llama's norm weights), so a
rule that picked other parameters, or a group option lost on the shards, fails.  Every step
sets the rate of the warmup-stable-decay schedule (2 warmup steps, then the decay: rates
1/2, 1 and 1/10 of the optimizer's) in every group of both.  SGD under every layout; AdamW
(decayed and not, by group) and Adam under those that shard the optimizer state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness import dist_pool_fixture
from harness.parity import assert_parity, check_training

pool2 = dist_pool_fixture(2, timeout_s=90)

EVERY = [
    ("single", "dp=2"),
    ("ddp", "dp=2"),
    ("zero1", "dp=2"),
    ("zero2", "fsdp=2"),
    ("fsdp", "fsdp=2"),
    ("hsdp", "fsdp=2"),
    ("tp", "tp=2"),
    ("tp_sp", "tp=2"),
    ("fsdp_tp", "fsdp=2"),
    ("fsdp_tp_sp", "tp=2"),
    ("pp", "pp=2"),
]
SHARDED_STATE = [("zero1", "dp=2"), ("zero2", "fsdp=2"), ("fsdp", "fsdp=2"), ("fsdp_tp", "tp=2")]


def _wsd(step: int) -> float:
    from meshlm.train.schedule import lr_at

    t = SimpleNamespace(lr=1.0, min_lr=0.1, warmup_steps=2, steps=3, schedule="wsd", decay_frac=0.34)
    return lr_at(step, t)


def _one_dim(_name, p) -> bool:
    return p.ndim == 1


def _job(layout: str, mesh: str, optims: tuple):
    assert [_wsd(k) for k in (1, 2, 3)] == [0.5, 1.0, pytest.approx(0.1)]
    return check_training(layout, mesh, optims=optims, no_decay=["axes:embed"], ref_no_decay=_one_dim, lr_factor=_wsd)


@pytest.mark.parametrize("layout,mesh", EVERY, ids=[f"{a}-{b}" for a, b in EVERY])
def test_sgd_groups_and_schedule_under_every_layout(pool2, layout, mesh):
    assert_parity(pool2.run(_job, layout, mesh, ("sgd",)))


@pytest.mark.parametrize("layout,mesh", SHARDED_STATE, ids=[f"{a}-{b}" for a, b in SHARDED_STATE])
def test_adam_and_adamw_groups_and_schedule(pool2, layout, mesh):
    assert_parity(pool2.run(_job, layout, mesh, ("adamw", "adam")))
