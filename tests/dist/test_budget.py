"""Collective budgets: every collective of one training step (forward, backward,
ShardedOptimizer.step) per shipped layout on 4 gloo processes, llama_tiny, fp32, counted
with meshlm.runtime.comm.CommCounter, must equal a budget derived from the formulas in docs/layouts.md's shipped-layouts table
(count and logical bytes per collective kind, mesh axis and phase).  An extra all-gather,
all-reduce or reduce-scatter anywhere fails the test.

Notation (per rank): P = parameter bytes (fp32, whole model), Pb = bytes of the block
parameters, L layers (blocks), nk = L + 3 collectives of a
bucketed pass (one flat collective per block, NOTE [block buckets] in meshlm/runtime/bucket/__init__.py, plus
one per parameter outside the blocks: tok_emb, the final norm, lm_head; L + 1 where those
three share one, NOTE [local root] in meshlm/runtime/lowering/local_root.py), bsh = local batch x seq x embed x 4
bytes (one activation of the residual stream).
"""

from __future__ import annotations

import pytest

from harness import dist_pool_fixture

B, S = 4, 8  # global batch, sequence
pool4 = dist_pool_fixture(4, timeout_s=60)


def _count_step(layout: str, mesh_shape: dict, **shard_kw):
    from meshlm.runtime.comm import count_step
    from harness.setup import tiny_sharded

    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S, **shard_kw)
    return _summary(count_step(model, opt, x, y, mesh))


def _summary(cc) -> dict:
    """(kind, axes, phase) -> (count, bytes) of a counted step."""
    return {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary(by_phase=True).items()}


def _count_step_prefetching(layout: str, mesh_shape: dict):
    from meshlm.runtime.comm import count_step
    from meshlm.runtime.lowering import shard_state
    from harness.setup import tiny_sharded

    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S, overlap=True)
    counts = _summary(count_step(model, opt, x, y, mesh))
    return counts, dict(shard_state(model).prefetch.stats)


def _sizes():
    from meshlm.models import llama_config

    c = llama_config("llama_tiny")
    hd = c.hd
    attn = [c.heads * hd * c.embed, c.kv_heads * hd * c.embed, c.kv_heads * hd * c.embed, c.embed * c.heads * hd]
    mlp = [c.mlp * c.embed] * 3
    norms = [c.embed, c.embed]
    emb = [c.vocab * c.embed, c.vocab * c.embed]  # tok_emb, lm_head (untied)
    return c, attn, mlp, norms, emb


def budget(layout: str, mesh: dict) -> dict:
    """The textbook budget (docs/layouts.md, shipped layouts) for one step of llama_tiny, per (kind, axes, phase)."""
    c, attn, mlp, norms, emb = _sizes()
    L, h = c.layers, c.embed
    t = mesh.get("tp", 1)
    # parameter bytes as seen by one tp rank: heads/kv_heads/mlp/vocab dims split over tp
    tp_sharded = layout in ("tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")
    k = t if tp_sharded else 1
    blk = [x // k for x in attn + mlp] + norms
    Pb = 4 * L * sum(blk)
    P = Pb + 4 * (sum(e // k for e in emb) + h)
    nk = L + 3
    data = {a: s for a, s in mesh.items() if a in ("dp", "fsdp") and s > 1}
    b_local = B // (max(1, mesh.get("dp", 1)) * max(1, mesh.get("fsdp", 1)))
    bsh = b_local * S * h * 4
    out: dict = {}

    def add(kind, axis, phase, count, nbytes):
        key = (kind, (axis,), phase)
        c0, b0 = out.get(key, (0, 0))
        out[key] = (c0 + count, b0 + nbytes)

    # The loss is a mean over the batch shards: one all-reduce per data mesh dim (DTensor
    # reduces a Partial scalar one mesh dim at a time), of 4 bytes.  Under a pure
    # data-parallel layout the root runs on local tensors (NOTE [local root] in
    # meshlm/runtime/lowering/local_root.py): the mean is combined from each rank's (loss x weight, weight), 8
    # bytes, and the parameters outside the blocks that compute uses as stored (ddp, zero2:
    # tok_emb, the final norm, lm_head) have their gradients reduced in one flat collective
    # at the end of backward, so a bucketed backward pass has L + 1 collectives, not nk.
    pure_data = layout in ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    if layout != "single":
        for a in data:
            add("all_reduce", a, "forward", 1, 8 if pure_data else 4)
    if pure_data:
        # Local blocks and roots may use different parameters on different ranks: at the step
        # one all-reduce per data mesh dim of a byte per parameter says which some rank used
        # (NOTE [unused parameters] in meshlm/runtime/unused.py); under DTensor every rank runs the
        # same program and none is needed.
        for a in data:
            add("all_reduce", a, "optimizer", 1, L * (len(attn) + len(mlp) + len(norms)) + len(emb) + 1)
    if layout == "ddp":  # DDP: all-reduce of the gradients, 2(N-1)/N·Ψ·B on the wire
        add("all_reduce", "dp", "backward", L + 1, P)
    elif layout == "zero1":  # ZeRO-1: reduce-scatter at the step + all-gather of the update,
        # each one flat collective per block and one for the parameters outside blocks,
        # which together are smaller than a block (NOTE [optimizer chunks] in
        # meshlm/runtime/optim/sharded.py)
        add("reduce_scatter", "dp", "optimizer", L + 1, P)
        add("all_gather", "dp", "optimizer", L + 1, P)
    elif layout == "zero2":  # ZeRO-2: reduce-scatter in backward + all-gather after the step
        add("reduce_scatter", "dp", "backward", L + 1, P)
        add("all_gather", "dp", "optimizer", L + 1, P)
    elif layout in ("fsdp", "hsdp", "fsdp_tp", "fsdp_tp_sp"):
        # ZeRO-3: all-gather in forward, again in backward, reduce-scatter of the grads:
        # 3(N-1)/N·Ψ·B.  Saving: only block parameters are re-gathered in backward
        # (NOTE [re-gather in backward] in meshlm/runtime/lowering/policies.py); the embedding's backward needs no
        # weight, and the final norm and lm_head, used last in forward and first in
        # backward, stay gathered between the two (3 tensors, P - Pb bytes, saved).
        add("all_gather", "fsdp", "forward", nk, P)
        add("all_gather", "fsdp", "backward", L, Pb)
        add("reduce_scatter", "fsdp", "backward", nk, P)
        if layout == "hsdp":
            # HSDP: the reduce-scattered shard (P / fsdp) is all-reduced over dp.
            add("all_reduce", "dp", "backward", nk, P // mesh["fsdp"])
    if layout in ("tp", "fsdp_tp"):
        # Megatron TP: 2 all-reduces of bsh per block forward, 2 backward; plus the
        # vocab-parallel embedding, whose Partial output is all-reduced (1 x bsh forward;
        # its backward needs none: each rank keeps its vocab rows' gradient), and the
        # vocab-parallel output head, a column-parallel linear whose input gradient is
        # all-reduced (1 x bsh backward), as Megatron's output layer does.
        add("all_reduce", "tp", "forward", 2 * L + 1, (2 * L + 1) * bsh)
        add("all_reduce", "tp", "backward", 2 * L + 1, (2 * L + 1) * bsh)
    if layout in ("tp_sp", "fsdp_tp_sp"):
        # TP+SP: each all-reduce becomes an all-gather + a reduce-scatter of the same bsh:
        # forward gathers the two inputs of each block and the output head's input (2L+1) and
        # reduce-scatters each block's two outputs and the embedding's (2L+1); backward
        # mirrors it.  Extra under SP: the norm weights see a seq-sharded input, so their
        # gradients (2L+1 norms, h floats) are all-reduced.
        add("all_gather", "tp", "forward", 2 * L + 1, (2 * L + 1) * bsh)
        add("reduce_scatter", "tp", "forward", 2 * L + 1, (2 * L + 1) * bsh)
        add("all_gather", "tp", "backward", 2 * L + 1, (2 * L + 1) * bsh)
        add("reduce_scatter", "tp", "backward", 2 * L + 1, (2 * L + 1) * bsh)
        # The norm weights' gradients are reduce-scattered over fsdp first, then all-reduced
        # over tp on the 1/fsdp shard.  With a bucket (fsdp > 1) a block's two norms take one
        # flat reduce-scatter and one flat all-reduce of their own (their own route, so that
        # their buffers die together; meshlm/runtime/bucket/op.py), the final norm its own per-parameter ones.
        bucketed = mesh.get("fsdp", 1) > 1
        add("all_reduce", "tp", "backward", L + 1 if bucketed else 2 * L + 1,
            (2 * L + 1) * h * 4 // mesh.get("fsdp", 1))
        if bucketed:
            add("reduce_scatter", "fsdp", "backward", L, 0)
    # No recomputed activation collectives: a re-gathering block (fsdp_tp, fsdp_tp_sp) runs
    # under selective checkpointing that keeps the outputs of its tp collectives
    # (meshlm/runtime/lowering/policies.py SAVED_COLLECTIVES), so backward re-runs only the parameter gathers.
    return out


CASES = [
    ("single", {"dp": 4}), ("ddp", {"dp": 4}), ("zero1", {"dp": 4}), ("zero2", {"dp": 4}),
    ("fsdp", {"fsdp": 4}), ("hsdp", {"dp": 2, "fsdp": 2}), ("tp", {"tp": 4}), ("tp_sp", {"tp": 4}),
    ("fsdp_tp", {"fsdp": 2, "tp": 2}), ("fsdp_tp_sp", {"fsdp": 2, "tp": 2}),
]


def _diff(measured: dict, expected: dict) -> dict:
    """(kind, axes, phase) -> (measured, budget) where they differ."""
    return {k: (measured.get(k), expected.get(k)) for k in set(measured) | set(expected)
            if measured.get(k) != expected.get(k)}


@pytest.mark.parametrize("layout,mesh", CASES, ids=[c[0] for c in CASES])
def test_budget(pool4, layout, mesh):
    measured = pool4.run(_count_step, layout, mesh)
    assert all(m == measured[0] for m in measured[1:]), "ranks disagree on their collectives"
    diff = _diff(measured[0], budget(layout, mesh))
    assert not diff, f"{layout} {mesh}: (kind, axes, phase): (measured, budget) (count, bytes): {diff}"


@pytest.mark.parametrize("layout,mesh", [("fsdp", {"fsdp": 4}), ("hsdp", {"dp": 2, "fsdp": 2})], ids=["fsdp", "hsdp"])
def test_budget_with_prefetch(pool4, layout, mesh):
    """With overlap (NOTE [prefetch] in meshlm/runtime/bucket/prefetch.py) each block's gather is issued one
    block ahead, in forward and in the backward recompute, and the step's collectives are
    still exactly the budget: every prefetched gather is the block's own, used once."""
    res = pool4.run(_count_step_prefetching, layout, mesh)
    L = 2  # llama_tiny layers
    for counts, stats in res:
        assert counts == budget(layout, mesh)
        # forward: blocks 1..L-1 prefetched; backward recompute: blocks L-2..0
        assert stats == {"issued": 2 * (L - 1), "used": 2 * (L - 1), "stale": 0}, stats


def _count_step_with_extra_gather(layout: str, mesh_shape: dict):
    """A counted step with one extra all-gather of a float over dp at the model's entry."""
    import torch

    from meshlm import _torch_compat as compat
    from meshlm.runtime.bucket import waited
    from meshlm.runtime.comm import count_step
    from harness.setup import tiny_sharded

    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S)
    group = mesh.get_group(0).group_name

    def extra(*_):
        waited(compat.all_gather_single(torch.ones(1), 0, group))

    model.register_forward_pre_hook(extra)
    return _summary(count_step(model, opt, x, y, mesh))


def test_extra_all_gather_fails_budget(pool4):
    """The check bites: a step that really runs one more all-gather (4 bytes gathered from
    4 ranks) differs from the budget by exactly that collective."""
    for measured in pool4.run(_count_step_with_extra_gather, "ddp", {"dp": 4}):
        assert _diff(measured, budget("ddp", {"dp": 4})) == {("all_gather", ("dp",), "forward"): ((1, 16), None)}


def _zero_step_with_buckets(layout: str, mesh_shape: dict, bucket_mbs: list):
    """One step per optimizer bucket size, each on a fresh copy of the same model: the
    optimizer-phase collectives and the updated parameters."""
    import torch

    from meshlm.runtime.comm import count_step
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from harness.setup import tiny_sharded

    out = []
    for mb in bucket_mbs:
        mesh, model, _opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S)
        opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, bucket_mb=mb)
        counts = _summary(count_step(model, opt, x, y, mesh))
        out.append((counts, {n: p.full_tensor() for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_optimizer_bucket_mb(pool4, layout):
    """``ShardedOptimizer(bucket_mb=...)`` (NOTE [optimizer chunks]): a tiny cap keeps one
    chunk per block and one for the outside parameters (the budget); a cap above the model's size
    makes one reduce-scatter (ZeRO-1) and one all-gather per step, with the same bytes and
    the same update (up to the summation order of a differently laid-out flat buffer)."""
    import torch

    mesh = {"dp": 4}
    (small, p_small), (big, p_big) = pool4.run(_zero_step_with_buckets, layout, mesh, [1e-6, 1e3])[0]
    expected = budget(layout, mesh)
    assert small == expected
    for key, (count, nbytes) in expected.items():
        merged = key[2] == "optimizer"
        assert big[key] == ((1 if merged else count), nbytes), (key, big[key])
    assert set(big) == set(expected)
    for n in p_small:
        torch.testing.assert_close(p_big[n], p_small[n], msg=lambda m, n=n: f"{n}: {m}")
