"""Expert parallel and context parallel inside pipeline stages, against one device
(``check_training``: each micro-batch loss, the gradient each optimizer steps with and
every parameter after 2 SGD steps of 2 micro-batches; the stages' parameters checked on
the ranks that hold them).

Expert parallel: a mixture of experts under ``fsdp_ep_pp`` on ep=2 x pp=2, one block per
stage; its load-balancing and z-loss coefficients are on (moe_tiny's 0.01 and 0.001), so
stage 0's block's auxiliary loss reaches the loss only through the side outputs stage 0
sends (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py): dropped, the loss is off
by 260x its tolerance; sent without its gradient, tok_emb's gradient by 439x.
"""

from __future__ import annotations

import pytest

from harness import dist_pool_fixture
from harness.parity import MoEBuild, TokenBatches, assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=60)

BATCHES = TokenBatches(batch=8, seq=16)


def _moe(pool, build, schedule):
    return pool.run(
        check_training,
        "fsdp_ep_pp",
        "ep=2,pp=2",
        build=build,
        batches=BATCHES,
        optims=("sgd",),
        steps=2,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ep_inside_stages(pool4, schedule):
    assert_parity(_moe(pool4, MoEBuild(), schedule))


def test_ep_inside_stages_shared_experts(pool4):
    """The fine-grained shape with a gated shared expert (Qwen2-MoE's), capacity routing."""
    assert_parity(_moe(pool4, MoEBuild("moe_shared_tiny", (("capacity_factor", 1.0),)), "1f1b"))
