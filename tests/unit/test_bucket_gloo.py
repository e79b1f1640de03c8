"""meshlm.bucket's flat collectives on a real one-rank gloo group: the functional collectives'
arguments are ones c10d takes, the in-place all-reduce writes into the packed buffer, and
``wait=False`` leaves a result in flight (an AsyncCollectiveTensor) that ``wait=True`` does
not (NOTE [overlapped reduction]).  The layouts over several ranks:
tests/unit/test_bucket_collectives.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from meshlm import bucket


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
