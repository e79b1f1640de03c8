"""The mixture-of-experts model (meshlm/models/moe.py) trains as on one device under every
layout that applies, expert parallel included (harness.parity.check_training: loss, the
gradient the optimizer steps with, every parameter and optimizer state after 3 steps of 2
micro-batches, SGD), dropless and with capacity routing (the token group is a sequence
under every layout: NOTE [moe routing] in meshlm/core/moe.py); with every token routed away
from some experts; and the router's logits, the per-row aux losses and the per-expert token
counts equal one device's under each layout."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture
from harness.parity import MoEBuild, TokenBatches, assert_parity, check_training

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)


BATCHES = TokenBatches(batch=8, seq=16)
CAPACITY = (("capacity_factor", 0.5),)

ON_2 = [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2"), ("fsdp_ep", "ep=2")]
ON_4 = [("fsdp_tp", "fsdp=2,tp=2"), ("fsdp_ep", "fsdp=2,ep=2")]


def _ok(results):
    assert_parity(results)


@pytest.mark.parametrize("layout,mesh", ON_2)
def test_moe_matches_one_device(pool2, layout, mesh):
    _ok(pool2.run(check_training, layout, mesh, build=MoEBuild(), batches=BATCHES, optims=("sgd",)))


@pytest.mark.parametrize("layout,mesh", ON_4)
def test_moe_matches_one_device_4(pool4, layout, mesh):
    _ok(pool4.run(check_training, layout, mesh, build=MoEBuild(), batches=BATCHES, optims=("sgd",)))


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("tp", "tp=2"), ("fsdp_ep", "ep=2")])
def test_qwen_attention_options_match_one_device(pool2, layout, mesh):
    """Query/key/value biases and per-head query/key norms (Qwen2-MoE's and Qwen3-MoE's
    options, both on here) train as on one device: they shard by their declared axes
    (``bq (heads, head_dim)`` over tp under tp)."""
    build = MoEBuild(overrides=(("qkv_bias", True), ("qk_norm", True)))
    _ok(pool2.run(check_training, layout, mesh, build=build, batches=BATCHES, optims=("sgd",)))


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("tp", "tp=2"), ("fsdp_ep", "ep=2")])
def test_capacity_routing_matches_one_device(pool2, layout, mesh):
    """Capacity 0.5 drops pairs in every sequence; the group is the sequence everywhere."""
    build = MoEBuild(overrides=CAPACITY)
    _ok(pool2.run(check_training, layout, mesh, build=build, batches=BATCHES, optims=("sgd",)))


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("fsdp_ep", "ep=2")])
def test_experts_without_tokens_match_one_device(pool2, layout, mesh):
    """Every token routed away from experts 5-7 (one of them on each ep rank's half or not):
    their weights get an exact zero gradient and stay as on one device, AdamW's weight decay
    included."""
    build = MoEBuild(away=(5, 6, 7))  # the bias is set on a real model, which shard then distributes
    runs = pool2.run(
        check_training, layout, mesh, build=build, batches=BATCHES, optims=("sgd", "adamw"), from_seed=False
    )
    _ok(runs)


def _observe(layout: str, mesh_shape: str, model: str, overrides: tuple) -> list:
    """Every routing quantity the MoE layers constrain (router logits, per-row aux losses,
    per-row kept token counts per expert), as global tensors, sharded and on one device."""
    import torch.distributed as dist

    import meshlm
    from meshlm.core.annotate import observing

    build = MoEBuild(model, overrides)
    mesh = meshlm.make_mesh(mesh_shape)
    sharded = meshlm.shard(build("meta", 0), layout, mesh, seed=0)
    (tokens, labels), _ = BATCHES(0, 0)
    wanted = {("batch", None, None), ("batch",), ("batch", None)}

    def run(model, args):
        seen = []
        with observing(lambda t, axes: seen.append((tuple(axes), t)) if tuple(axes) in wanted else None):
            model(*args).backward()
        return seen

    def whole(t):
        if hasattr(t, "full_tensor"):
            return t.full_tensor().detach()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts)

    got = [(a, whole(t)) for a, t in run(sharded, [meshlm.shard_batch(x, layout, mesh) for x in (tokens, labels)])]
    want = [(a, t.detach()) for a, t in run(build("cpu", 0), (tokens, labels))]
    return [(a, g, w) for (a, g), (_, w) in zip(got, want, strict=True)]


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2"), ("fsdp_ep", "ep=2")])
@pytest.mark.parametrize("model,overrides", [("moe_tiny", CAPACITY), ("moe_shared_tiny", ())])
def test_routing_observed_equal_one_device(pool2, layout, mesh, model, overrides):
    for rank in pool2.run(_observe, layout, mesh, model, overrides):
        assert len(rank) == 3 * 2  # logits, counts and aux of each of the 2 blocks
        for axes, got, want in rank:
            exact = axes == ("batch", None)  # token counts are integers
            torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


pool8 = dist_pool_fixture(8, timeout_s=120)


def test_fsdp_tp_ep_matches_one_device(pool8):
    """Expert parallel, expert tensor parallel and ZeRO-3 at once on 8 processes: one MoE block,
    two SGD steps of one micro-batch (the 3-D mesh is the point; accumulation over micro-batches
    and two blocks run on tp=2 x ep=2 below)."""
    build = MoEBuild(overrides=(("layers", 1),))
    _ok(pool8.run(check_training, "fsdp_tp_ep", "fsdp=2,tp=2,ep=2", build=build, batches=BATCHES, optims=("sgd",),
                  steps=2, grad_accum=1))


def test_tp_ep_matches_one_device(pool4):
    """The vocab-parallel loss with the logits' rows split over ep and the labels' not
    (NOTE [target rows] in meshlm/_torch_compat/dtensor_loss.py)."""
    _ok(pool4.run(check_training, "fsdp_tp_ep", "tp=2,ep=2", build=MoEBuild(), batches=BATCHES, optims=("sgd",)))
