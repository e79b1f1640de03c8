"""meshlm.runtime.bucket's flat collectives on a real one-rank gloo group: the functional collectives'
arguments are ones c10d takes, the in-place all-reduce writes into the packed buffer, and
``wait=False`` leaves a result in flight (an AsyncCollectiveTensor) that ``wait=True`` does
not (NOTE [overlapped reduction]).  The layouts over several ranks:
tests/unit/test_bucket_collectives.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from meshlm.core.errors import MeshlmError
from meshlm.runtime import bucket
from meshlm.runtime.in_flight import InFlight, own


@pytest.fixture
def group():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _pending(t) -> bool:
    return isinstance(t, funcol.AsyncCollectiveTensor)


def test_all_reduce_inplace_reduces_the_buffer_itself(group):
    flat = torch.arange(6.0)
    out = bucket.flat.all_reduce_inplace(flat, group, True)
    assert not _pending(out) and out.data_ptr() == flat.data_ptr() and torch.equal(out, torch.arange(6.0))
    out = bucket.flat.all_reduce_inplace(flat, group, False)
    assert _pending(out) and torch.equal(out.wait(), torch.arange(6.0))


@pytest.mark.parametrize("wait", [True, False])
def test_flat_reductions_wait_or_leave_in_flight(group, wait):
    gs = [torch.arange(4.0).view(2, 2), torch.ones(3, dtype=torch.bfloat16)]
    for out in (
        bucket.flat.reduce_scatter_flat(gs, [1, 0], group, 1, wait=wait, dtype=torch.float32),
        bucket.flat.all_reduce_flat(gs, group, wait=wait, dtype=torch.float32),
        bucket.flat.all_reduce_flat(gs[:1], group, wait=wait),
    ):  # a gradient as it is: out of place
        assert [_pending(y) for y in out] == [not wait] * len(out)
        got = [y.wait() if _pending(y) else y for y in out]
        assert all(torch.equal(y, g.to(y.dtype)) for y, g in zip(got, gs))


def test_flat_moves_wait_unless_told_not_to(group):
    from torch.distributed.tensor import Partial, Replicate, Shard

    for kind, target in (("ar", Replicate()), ("rs", Shard(0))):
        for kw, pending in (({}, False), ({"wait": True}, False), ({"wait": False}, True)):
            xs, pls = [torch.ones(3)], [[Partial()]]
            bucket.flat.flat_moves(xs, pls, [(target,)], (1,), (group,), [(kind, 0)], **kw)
            assert _pending(xs[0]) == pending and pls == [[target]], (kind, kw)
            assert torch.equal(xs[0].wait() if pending else xs[0], torch.ones(3))


def test_gather_flat_on_one_rank(group):
    xs = [torch.arange(4.0).view(2, 2), torch.ones(3)]
    ys = bucket.flat.gather_flat(xs, [1, 0], group, 1)
    assert not any(_pending(y) for y in ys) and all(torch.equal(y, x) for y, x in zip(ys, xs))


@pytest.mark.parametrize("others", [True, False])
def test_gradients_left_in_flight_are_settled_when_backward_ends(group, others):
    """NOTE [overlapped reduction]: a gradient whose reduction is still in flight when its
    block's backward returns is queued (``op._settle_later``) on its model's InFlight; when
    the backward pass ends it is waited for and stored as a DTensor of a plain tensor, placed
    and shaped as it was.  The others, and parameters without a gradient, are left as they
    are, and another model's InFlight is never touched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from meshlm._torch_compat import dtensor_ops

    mesh = init_device_mesh("cpu", (1,))

    def param():
        return torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 2), mesh, (Shard(0),), run_check=False))

    pending, done, none = param(), param(), param()
    box, other = InFlight(), InFlight()
    own((pending, done, none), box)
    values = torch.arange(8.0).view(4, 2)
    settled = dtensor_ops.wrap(values + 1, mesh, (Shard(0),), (4, 2), (2, 1))

    class Block(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            flight = funcol.all_reduce(values.clone(), "sum", group)
            assert _pending(flight)
            pending.grad = dtensor_ops.wrap(flight, mesh, (Shard(0),), (4, 2), (2, 1))
            done.grad = settled
            queued = (pending, done, none) if others else (pending,)
            for p in queued:
                bucket.op._settle_later(p)
            assert len(box.grads) == len(queued) and len(other) == 0  # settled at the end, not now
            return g

    Block.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert len(box) == 0 and len(other) == 0
    g = pending.grad
    assert isinstance(g, DTensor) and not _pending(g._local_tensor) and torch.equal(g._local_tensor, values)
    assert g.device_mesh is mesh and tuple(g.placements) == (Shard(0),) and g.shape == (4, 2) and g.stride() == (2, 1)
    assert done.grad is settled and none.grad is None


def test_a_gradient_in_flight_of_a_parameter_of_no_model_is_an_error():
    """Only a sharded model's parameters know where their gradients in flight wait."""
    with pytest.raises(MeshlmError, match=r"shape \(4, 2\).*belongs to no sharded model"):
        bucket.op._settle_later(torch.nn.Parameter(torch.zeros(4, 2)))
