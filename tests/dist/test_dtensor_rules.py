"""DTensor rules meshlm fixes (meshlm/_dtensor_ops.py), checked against one device.

NOTE [mean loss backward]: torch's DTensor gives the gradient of a mean-reduced
elementwise loss on a batch-sharded input (number of shards) times too large.
"""

import pytest
import torch
import torch.nn.functional as F

from meshlm.testing import dist_pool_fixture

pool4 = dist_pool_fixture(4, timeout_s=60)

LOSSES = {
    "mse": F.mse_loss,
    "smooth_l1": F.smooth_l1_loss,
    "huber": F.huber_loss,
    "bce": lambda a, b: F.binary_cross_entropy(torch.sigmoid(a), b),
    "soft_margin": F.soft_margin_loss,
    "mse_sum": lambda a, b: F.mse_loss(a, b, reduction="sum"),
    "l1": F.l1_loss,
    "bce_logits": F.binary_cross_entropy_with_logits,
    "kl_batchmean": lambda a, b: F.kl_div(F.log_softmax(a, -1), b, reduction="batchmean"),
}


def _losses_job(mesh_shape, rows):
    return {name: _loss_job(name, mesh_shape, rows) for name in LOSSES}


def _loss_job(name, mesh_shape, rows):
    from torch.distributed.tensor import distribute_tensor

    import meshlm
    from meshlm import _dtensor_ops
    from meshlm.lower import placements
    from meshlm.testing import tolerances as tol

    _dtensor_ops.install()
    fn = LOSSES[name]
    g = torch.Generator().manual_seed(0)
    x0, t = torch.randn(rows, 6, generator=g), torch.rand(rows, 6, generator=g)
    x = x0.clone().requires_grad_()
    ref = fn(x, t)
    ref.backward()
    mesh = meshlm.make_mesh(mesh_shape)
    pl = placements((("dp",), ()), mesh)  # rows split over dp, replicated over anything else
    xd = distribute_tensor(x0, mesh, pl).requires_grad_()
    loss = fn(xd, distribute_tensor(t, mesh, pl))
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref, rtol=tol.LOSS_RTOL, atol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(xd.grad.full_tensor(), x.grad, rtol=tol.GRAD_RTOL,
                               atol=tol.GRAD_ATOL_OF_MAX * float(x.grad.abs().max()), msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("mesh,rows", [("dp=4", 8), ("dp=2,tp=2", 6)])
def test_reduced_loss_gradients_on_batch_sharded_inputs(pool4, mesh, rows):
    """For every loss in LOSSES, the loss and the input gradient equal one device's
    (shard_batch refuses uneven row splits, so only even ones are checked)."""
    for r in pool4.run(_losses_job, mesh, rows):
        assert r == {name: True for name in LOSSES}
