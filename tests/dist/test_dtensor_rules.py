"""DTensor rules meshlm fixes (the meshlm/_torch_compat/dtensor_*.py that dtensor_ops.py installs), against one device.

NOTE [mean loss backward]: torch's DTensor gives the gradient of a mean-reduced
elementwise loss on a batch-sharded input (number of shards) times too large.
"""

import pytest
import torch
import torch.nn.functional as F

from harness import dist_pool_fixture

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
    from meshlm._torch_compat import dtensor_ops as _dtensor_ops
    from meshlm.runtime.lowering import placements
    from harness import tolerances as tol

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


def _finer_split_job():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshlm
    from meshlm._torch_compat import dtensor_ops as _dtensor_ops
    from harness import tolerances as tol

    _dtensor_ops.install()
    mesh = meshlm.make_mesh("tp=2,ep=2")
    g = torch.Generator().manual_seed(0)
    x0, t = torch.randn(4, 4, 6, generator=g), torch.randn(4, 4, 6, generator=g)
    out = {}
    for name in ("mse", "smooth_l1", "huber", "soft_margin"):
        x = x0.clone().requires_grad_()
        LOSSES[name](x, t).backward()
        xd = distribute_tensor(x0, mesh, [Replicate(), Shard(0)]).requires_grad_()
        loss = LOSSES[name](xd, distribute_tensor(t, mesh, [Shard(1), Shard(0)]))
        loss.full_tensor().backward()
        torch.testing.assert_close(xd.grad.full_tensor(), x.grad, rtol=tol.GRAD_RTOL,
                                   atol=tol.GRAD_ATOL_OF_MAX * float(x.grad.abs().max()), msg=lambda m: f"{name}: {m}")  # fmt: skip
        out[name] = True
    return out


def test_mean_loss_backward_where_the_rule_splits_the_input_further(pool4):
    """NOTE [mean loss backward] where the input came replicated over tp and the target
    split over tp: DTensor's rule splits the input too, so the kernel's mean is over a
    quarter of the elements, not the half the input held (found by benchmarks/moe_bench.py's
    MoE stack under fsdp_tp_ep on tp=2 x ep=2: every gradient 2x one device's)."""
    for r in pool4.run(_finer_split_job):
        assert r == {name: True for name in ("mse", "smooth_l1", "huber", "soft_margin")}


# --------------------------------------------------------------------------- NOTE [local view]
def _local_view_job(mesh_shape):
    """A user's attention-style ``o.transpose(1, 2).flatten(2, 3)`` on a DTensor whose local
    tensor a redistribute left contiguous while its global strides say (b, s, h, d)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshlm
    from meshlm._torch_compat import dtensor_ops as _dtensor_ops
    from harness import tolerances as tol

    _dtensor_ops.install()
    mesh = meshlm.make_mesh(mesh_shape)
    n = mesh.size()
    g = torch.Generator().manual_seed(0)
    x0, w = torch.randn(2, 3, 4 * n, generator=g), torch.randn(5, 4 * n, generator=g)

    def f(x, w, heads):  # (b, s, heads * d) -> heads -> back, then a projection
        o = x.unflatten(-1, (heads, -1)).transpose(1, 2) * 2.0
        return F.linear(o.transpose(1, 2).flatten(2, 3), w)

    x = x0.clone().requires_grad_()
    ref = f(x, w, 2 * n).sin().sum()
    ref.backward()
    xd = distribute_tensor(x0, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()] * mesh.ndim)
    o = xd.unflatten(-1, (2 * n, -1)).transpose(1, 2)  # (b, h, s, d), strides of (b, s, h, d)
    # Shard the heads and gather them back: the local tensor comes back contiguous in
    # (b, h, s, d) while the DTensor keeps the global strides of the transpose.
    o = o.redistribute(mesh, [Shard(1)] * mesh.ndim).redistribute(mesh, [Replicate()] * mesh.ndim) * 2.0
    assert o.transpose(1, 2).is_contiguous() and not o._local_tensor.transpose(1, 2).is_contiguous()
    got = F.linear(o.transpose(1, 2).flatten(2, 3), wd).sin().sum()
    got.backward()
    torch.testing.assert_close(got.full_tensor(), ref, rtol=tol.LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        xd.grad.full_tensor(), x.grad, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * float(x.grad.abs().max())
    )
    # Where the local tensor can be viewed, the result is still a view of it (no copy).
    v = distribute_tensor(x0, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    assert v.view(2, 3 * 4 * n)._local_tensor.data_ptr() == v._local_tensor.data_ptr()
    return True


@pytest.mark.parametrize("mesh", ["tp=4", "dp=2,tp=2"])
def test_view_of_a_gathered_transpose(pool4, mesh):
    """NOTE [local view]: the view DTensor allows from its global strides, on a local
    tensor whose layout differs, is a copy (as reshape) with one device's values and
    gradients, not a raw "view size is not compatible" error."""
    assert all(pool4.run(_local_view_job, mesh))


# --------------------------------------------------------------------------- NOTE [strided unflatten]
def _strided_unflatten_job(mesh_shape):
    """(batch, seq, vocab) with seq sharded over both mesh dims, flattened to rows for a
    loss (DTensor: two _StridedShards) and unflattened back, as the flatten's backward does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import meshlm
    from meshlm._torch_compat import dtensor_ops as _dtensor_ops
    from harness import tolerances as tol

    _dtensor_ops.install()
    mesh = meshlm.make_mesh(mesh_shape)
    g = torch.Generator().manual_seed(0)
    x0, t = torch.randn(3, 8, 5, generator=g), torch.randn(3, 8, 5, generator=g)
    x = x0.clone().requires_grad_()
    ref = (x.flatten(0, 1).sin() * t.flatten(0, 1)).sum()
    ref.backward()
    pl = [Shard(1)] * mesh.ndim
    xd = distribute_tensor(x0, mesh, pl).requires_grad_()
    flat = xd.flatten(0, 1)
    assert all(type(p).__name__ == "_StridedShard" for p in flat.placements), flat.placements
    back = flat.view(3, 8, 5)  # DTensor's own view rule raises here (torch 2.13)
    assert tuple(back.placements) == tuple(pl)
    assert back._local_tensor.data_ptr() == xd._local_tensor.data_ptr()  # still a view
    torch.testing.assert_close(back.full_tensor(), x0, rtol=0, atol=0)
    got = (flat.sin() * distribute_tensor(t, mesh, pl).flatten(0, 1)).sum()
    got.backward()
    torch.testing.assert_close(got.full_tensor(), ref, rtol=tol.LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        xd.grad.full_tensor(), x.grad, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * float(x.grad.abs().max())
    )
    return True


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "dp=2,fsdp=2"])
def test_unflatten_of_seq_sharded_over_two_mesh_dims(pool4, mesh):
    """NOTE [strided unflatten]: the view back of rows flattened from a sequence sharded
    over two mesh dims, and the gradient through the flatten, as on one device."""
    assert all(pool4.run(_strided_unflatten_job, mesh))
