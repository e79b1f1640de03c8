"""Token weighting (NOTE [token weighting] in meshlm/core/weighting.py), on one process against
plain torch: micro-batches of unequal counted tokens combined by ``Accumulation`` give the
loss and the gradient of the whole batch in one forward; a loss's weight is read from
torch's NLL node, from ``reduce_batch(..., weight=)``, or is unknown."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import meshlm
from meshlm.core.errors import MeshlmError
from meshlm.core.weighting import Accumulation, rescale, weight_of


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 4, generator=gen)
    y = torch.randint(0, 7, (6, 5), generator=gen)
    y[:3, 1:] = -100  # the first half counts 3 targets, the second 15
    return x, y


def _loss(w, x, y):
    return F.cross_entropy((x @ w).flatten(0, 1), y.flatten(), ignore_index=-100)


def test_micro_batches_weigh_as_the_whole_batch():
    x, y = _data()
    w0 = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    whole = w0.clone().requires_grad_()
    ref = _loss(whole, x, y)
    ref.backward()
    w = torch.nn.Parameter(w0.clone())
    acc = Accumulation(2)
    for sl in (slice(0, 3), slice(3, 6)):
        loss = _loss(w, x[sl], y[sl])
        (loss * acc.coefficient(loss)).backward()
    rescale(acc.grad_factor(), model=torch.nn.ParameterList([w]))
    assert acc.total == 18.0 and acc.ref == 6.0  # the first micro-batch's 3 targets times 2
    assert math.isclose(acc.loss(), float(ref.detach()), rel_tol=1e-6)
    torch.testing.assert_close(w.grad, whole.grad, rtol=1e-6, atol=1e-7)
    # before the rescale the gradient is not the whole batch's (the test can tell them apart)
    assert not torch.allclose(w.grad / acc.grad_factor(), whole.grad, rtol=1e-3)


def test_equal_weights_leave_the_gradients_as_they_are():
    acc = Accumulation(4)
    coefs = [acc.add(8.0, 2.0) for _ in range(4)]
    assert coefs == [0.25] * 4 and acc.grad_factor() == 1.0 and acc.loss() == 2.0


def test_a_micro_batch_that_counts_nothing_adds_nothing():
    acc = Accumulation(3)
    assert acc.add(0.0, float("nan")) == 0.0  # all targets ignored: torch's mean is NaN
    assert acc.add(4.0, 1.0) == pytest.approx(1 / 3)
    assert acc.add(8.0, 4.0) == pytest.approx(2 / 3)
    assert acc.loss() == pytest.approx((4 * 1.0 + 8 * 4.0) / 12)
    assert acc.grad_factor() == pytest.approx(12 / 12)


def test_a_step_that_counts_nothing_has_a_nan_loss():
    acc = Accumulation(2)
    acc.add(0.0, float("nan"))
    acc.add(0.0, float("nan"))
    assert math.isnan(acc.loss()) and acc.grad_factor() == 1.0


def test_unknown_weights_count_once_each():
    acc = Accumulation(2)
    assert acc.add(None, 3.0) == 0.5 and acc.add(None, 5.0) == 0.5
    assert acc.loss() == 4.0 and acc.grad_factor() == 1.0


def test_mixed_kinds_of_loss_are_an_error():
    acc = Accumulation(2)
    acc.add(3.0, 1.0)
    with pytest.raises(MeshlmError, match="different kinds"):
        acc.add(None, 1.0)


def test_weight_of_reads_torch_and_declared_weights():
    x, y = _data()
    w = torch.randn(4, 7, requires_grad=True)
    assert weight_of(_loss(w, x, y)) == 18.0
    assert weight_of(F.cross_entropy((x @ w).flatten(0, 1), y.flatten(), reduction="sum")) is None
    assert weight_of((x @ w).square().mean()) is None
    mask = (y >= 0).float()
    per = F.cross_entropy((x @ w).flatten(0, 1), y.clamp_min(0).flatten(), reduction="none").view_as(mask)
    mean = (per * mask).sum() / mask.sum()
    declared = meshlm.reduce_batch(mean, "mean", weight=mask.sum())
    assert weight_of(declared) == 18.0 and torch.equal(declared, mean)
    with pytest.raises(ValueError, match="op='mean' only"):
        meshlm.reduce_batch(mean, "sum", weight=mask.sum())


def test_rescale_a_plain_optimizers_gradients():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    opt = torch.optim.SGD([p], lr=0.1)
    rescale(0.25, opt)
    assert torch.equal(p.grad, torch.full((3,), 0.5))
    rescale(1.0, opt)
    assert torch.equal(p.grad, torch.full((3,), 0.5))


def test_rescale_a_sharded_optimizer_through_its_reduced_gradients():
    """A ShardedOptimizer's gradients are rescaled after its reduction (ZeRO's masters have
    none before it), by its own ``scale_grads`` (main and offloaded gradients included)."""
    calls = []

    class Sharded:
        param_groups: list = []  # a plain optimizer's path would scale nothing here

        def reduce_grads(self):
            calls.append("reduce")

        def scale_grads(self, factor):
            calls.append(factor)

    rescale(0.5, Sharded())
    assert calls == ["reduce", 0.5]
    rescale(1.0, Sharded())
    assert calls == ["reduce", 0.5]
