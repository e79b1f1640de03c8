"""Expert parallelism's collectives: one training step of moe_tiny under fsdp_ep on
fsdp=2 x ep=2 (4 gloo processes), counted with meshlm.runtime.comm.CommCounter.  Each MoE
layer moves its token buffer to the experts' ep ranks and back by one all-to-all each way in
forward and in backward (NOTE [moe routing] in meshlm/core/moe.py), each of the routing's
formula size: the buffer's local share, (batch / (fsdp * ep)) x experts x capacity x embed
x 4 bytes, capacity = capacity(seq, experts, top_k, capacity_factor).  The buffer is never
all-gathered over ep (torch's CPU fallback would: NOTE [cpu all-to-all] in
meshlm/_torch_compat/dtensor_alltoall.py); the one all-gather over ep is the gradient of the
token embeddings in backward, (batch / fsdp) x seq x embed x 4 bytes: ep ranks read the same
input rows and split them at the first constrain (docs/moe.md)."""

from __future__ import annotations

import pytest

from harness import dist_pool_fixture

B, S = 8, 16
pool4 = dist_pool_fixture(4, timeout_s=60)


def _count(layout: str, mesh_shape: str, overrides: tuple) -> dict:
    import torch

    import meshlm
    from meshlm.models import MoETransformer, moe_config
    from meshlm.runtime.comm import count_step
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(MoETransformer(moe_config("moe_tiny", **dict(overrides)), device="meta"), layout, mesh)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    toks = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    x, y = (meshlm.shard_batch(t, layout, mesh) for t in (toks[:, :-1], toks[:, 1:]))
    cc = count_step(model, opt, x, y, mesh)
    return {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary(by_phase=True).items()}


@pytest.mark.parametrize("overrides", [(), (("capacity_factor", 1.0),)], ids=["dropless", "capacity"])
def test_all_to_all_bytes_equal_the_routing_formula(pool4, overrides):
    from meshlm.core.moe import capacity
    from meshlm.models import moe_config

    c = moe_config("moe_tiny", **dict(overrides))
    cap = capacity(S, c.experts, c.top_k, c.capacity_factor)
    one = (B // 4) * c.experts * cap * c.embed * 4  # one buffer's local share, fp32
    for got in pool4.run(_count, "fsdp_ep", "fsdp=2,ep=2", overrides):
        a2a = {k: v for k, v in got.items() if k[0] == "all_to_all"}
        assert a2a == {
            ("all_to_all", ("ep",), "forward"): (2 * c.layers, 2 * c.layers * one),
            ("all_to_all", ("ep",), "backward"): (2 * c.layers, 2 * c.layers * one),
        }, got
        gathers = {k: v for k, v in got.items() if k[0] == "all_gather" and "ep" in k[1]}
        assert gathers == {("all_gather", ("ep",), "backward"): (1, (B // 2) * S * c.embed * 4)}, got
