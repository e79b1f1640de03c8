"""meshlm plan for a mixture of experts (NOTE [planned experts] in meshlm/plan/moe.py) on a
fake mesh of 16 ranks (fsdp=4 x ep=4): the experts' storage per rank, total and active
parameters, and the all-to-all bytes of the routing formula equal to the collectives the
measured step counted (the fake process group checks shapes and bytes, never numerics)."""

from __future__ import annotations

import pytest

from meshlm.core.moe import capacity
from meshlm.models import moe_config


class Build:
    def __init__(self, **overrides):
        self.overrides = overrides

    def __call__(self, device):
        from meshlm.models import MoETransformer

        return MoETransformer(moe_config("moe_tiny", **self.overrides), device=device)


@pytest.mark.parametrize(  # two blocks hold the per-block counts; one is enough for capacity's
    "overrides", [{}, {"capacity_factor": 1.25, "layers": 1}], ids=["dropless", "capacity"]
)
def test_planned_experts_and_all_to_all(overrides):
    from meshlm.plan import format_plan, plan_model

    B, S, accum = 32, 16, 2
    sizes = {"fsdp": 4, "ep": 4}
    p = plan_model(Build(**overrides), "fsdp_ep", sizes, global_batch=B, seq=S, grad_accum=accum, name="moe_tiny")
    c = moe_config("moe_tiny", **overrides)
    e = p.formulas["moe"]
    # each rank: experts / ep whole experts, each (3 matrices of mlp x embed) split over fsdp
    assert e["expert_bytes"] == c.layers * (c.experts // 4) * 3 * c.expert_mlp * (c.embed // 4) * 4
    assert (e["total"], e["active"]) == (c.num_params(), c.num_params(active=True))
    cap = capacity(S, c.experts, c.top_k, c.capacity_factor)
    one = (B // accum // 16) * c.experts * cap * c.embed * 4
    assert e["all_to_all_bytes"] == one and e["all_to_all_count"] == 2 * c.layers
    counted = {(x.phase, x.axes): (x.count, x.bytes) for x in p.comm if x.kind == "all_to_all"}
    n = accum * e["all_to_all_count"]
    assert counted == {("forward", ("ep",)): (n, n * one), ("backward", ("ep",)): (n, n * one)}
    text = format_plan(p)
    assert "experts" in text and f"{2 * c.layers} per micro-batch in forward" in text


def test_no_expert_parallel_no_all_to_all():
    from meshlm.plan import plan_model

    p = plan_model(Build(layers=1), "fsdp", {"fsdp": 4}, global_batch=8, seq=16, name="moe_tiny")
    e = p.formulas["moe"]
    assert e["all_to_all_count"] == 0 and not [x for x in p.comm if x.kind == "all_to_all"]
    assert e["expert_bytes"] == 8 * 3 * 32 * 16 * 4  # one block: experts whole, embed / 4
