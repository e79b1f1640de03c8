"""``lowering.policies``: the selective checkpoint policies of re-gathering blocks (NOTE
[re-gather in backward]) and ``keep_constraints``.

A policy says, op by op, what a re-gathering block saves for backward: the matmuls and
attention of DTensor code (not the plain-tensor kernels DTensor runs inside them), the
activation collectives, the random draws; everything else, and anything run while a
parameter is being gathered (the run state's ``gathering``), is recomputed.  The local policy (plain
tensors, one dispatch level) saves the matmuls themselves.  Then both policies run under
``torch.utils.checkpoint``: the gradients equal the block's without checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from harness.simworld import fake_mesh
from meshlm import _torch_compat as compat
from meshlm.core import annotate
from meshlm.core.state import RUN, counting, scope
from meshlm.runtime.lowering import policies

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
aten = torch.ops.aten


@pytest.fixture
def dt():
    """A DTensor argument (on a fake one-dim mesh) and a plain one."""
    mesh = fake_mesh((2,))
    yield DTensor.from_local(torch.ones(2, 2), mesh, (Replicate(),), run_check=False), torch.ones(2, 2)
    RUN.gathering = 0
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_dtensor_policy_saves_matmuls_collectives_and_draws(dt):
    d, t = dt
    wait = compat.c10d_functional.wait_tensor.default
    cases = [
        (aten.mm.default, (d, d), SAVE),  # a DTensor matmul
        (aten.addmm.default, (t, d, d), SAVE),  # any DTensor argument
        (aten.mm.default, (t, t), RECOMPUTE),  # the local kernel inside a DTensor op: never saved
        (aten.bmm.default, (t, t), RECOMPUTE),
        (compat.c10d_functional.all_reduce.default, (t, "sum", "g"), SAVE),  # an activation collective
        (wait, (t,), SAVE),
        (aten.rand.default, ([2],), SAVE),  # a random draw
        (aten.bernoulli.p, (t, 0.5), SAVE),
        (aten.add.Tensor, (d, d), RECOMPUTE),  # anything else: recomputed
        (aten.gelu.default, (d,), RECOMPUTE),
    ]
    for op, args, want in cases:
        assert policies.regather_policy(None, op, *args) == want, op
    with counting("gathering"):  # inside a parameter's gather: everything re-runs (it is the re-gather)
        for op, args, _want in cases:
            assert policies.regather_policy(None, op, *args) == RECOMPUTE, op


def test_the_local_policy_saves_plain_matmuls_and_draws(dt):
    _d, t = dt
    cases = [
        (aten.mm.default, (t, t), SAVE),
        (aten.addmm.default, (t, t, t), SAVE),
        (aten.bmm.default, (t, t), SAVE),
        (aten.rand.default, ([2],), SAVE),
        (aten.add.Tensor, (t, t), RECOMPUTE),
        (compat.c10d_functional.all_reduce.default, (t, "sum", "g"), RECOMPUTE),  # local blocks have none
    ]
    for op, args, want in cases:
        assert policies.regather_policy_local(None, op, *args) == want, op
    with counting("gathering", 2):
        for op, args, _want in cases:
            assert policies.regather_policy_local(None, op, *args) == RECOMPUTE, op


def test_attention_is_saved_where_torch_has_it():
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in policies.SAVED_OPS
    assert not policies.is_random(aten.mm.default) and policies.is_random(aten.randn.default)
    assert not policies.is_random(len)  # not an op: no tags


@pytest.mark.parametrize("context", ["regather_context", "regather_context_local"])
def test_a_block_under_each_policy_has_the_gradients_of_one_without(context):
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(4, 4, generator=g, requires_grad=True) for _ in range(2))
    x = torch.randn(3, 4, generator=g)

    def block(x):
        return torch.tanh(x @ w1).sin() @ w2

    block(x).square().sum().backward()
    ref = [w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    out = checkpoint(block, x, use_reentrant=False, context_fn=getattr(policies, context))
    out.square().sum().backward()
    assert torch.equal(w1.grad, ref[0]) and torch.equal(w2.grad, ref[1])


def test_keep_constraints_runs_the_function_under_the_handler_it_was_made_under():
    seen = []

    def fn(a, *, b):
        seen.append((annotate.active_handler(), a, b))
        return a + b

    def outer(x, axes):
        return x

    def other(x, axes):
        return x

    with scope(handler=outer):
        run = policies.keep_constraints(fn)
        assert run(1, b=2) == 3  # the same handler: called as it is
    assert run(3, b=4) == 7  # a recompute in backward, outside the root forward
    with scope(handler=other):
        assert run(5, b=6) == 11
        assert annotate.active_handler() is other  # restored after
    assert seen == [(outer, 1, 2), (outer, 3, 4), (outer, 5, 6)]
    assert annotate.active_handler() is None
