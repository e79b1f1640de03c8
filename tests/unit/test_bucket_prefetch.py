"""``bucket.prefetch`` (NOTE [prefetch]: a block's gather issues the next block's first
gather, which that block then uses) and ``bucket.local`` (NOTE [local blocks]: which inputs
are batch-sharded, outputs wrapped back), on fake meshes whose collectives stand for
replicas (``patch_replicas``), so a gathered parameter is its shard repeated along each
gathered mesh dim.  The blocks' stored parameters are plain shards (``_local_tensor``), as
in tests/unit/test_bucket_gather.py.

Checked: a prefetch is issued for the block that runs next (the next one in forward, the
previous one in backward) and nowhere else, once; the block that runs next uses it instead
of gathering, with the values of its own gather; a prefetch whose shards changed since
(written in place, or replaced) is dropped and gathered afresh, so a stale shard is never
used; only the first (inner) gather step is prefetched; the counters say so.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.simworld import data_bucket, fake_mesh, patch_replicas
from meshlm import _torch_compat as compat
from meshlm.core.errors import AnnotationError
from meshlm.runtime import bucket
from meshlm.runtime.bucket.prefetch import Prefetch, gather_locals

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
f32 = torch.float32


@pytest.fixture
def replicas(monkeypatch):
    """Patched collectives standing for replicas; the all-gathers issued, by group."""
    patch_replicas(monkeypatch)
    log: list[str] = []
    gather = compat.all_gather_single

    def logged(t, dim, group):
        log.append(group)
        return gather(t, dim, group)

    monkeypatch.setattr(compat, "all_gather_single", logged)
    yield log
    if dist.is_initialized():
        dist.destroy_process_group()


def _block(mesh, specs, seed):
    """A local bucket of ``specs`` ((storage, shape) per member, gathered to Replicate over
    every mesh dim, all data axes) and its stored shards."""
    full = [(s, (R,) * len(s), s, shape) for s, shape in specs]
    key, b, shards = data_bucket(mesh, full, overlap=True, seed=seed)
    return key, b, [SimpleNamespace(_local_tensor=t) for t in shards]


SPECS = [((S0,), (4, 3)), ((S1,), (3, 2)), ((R,), (5,))]


def _three_blocks():
    mesh = fake_mesh((2,))
    blocks = [_block(mesh, SPECS, seed) for seed in range(3)]
    pf = Prefetch()
    pf.link([k for k, _b, _ps in blocks], [lambda ps=ps: ps for _k, _b, ps in blocks])
    return blocks, pf


def _equal(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_the_next_blocks_gather_is_issued_early_and_used(replicas):
    log = replicas
    (b0, b1, b2), pf = _three_blocks()
    want = [gather_locals(b, ps, None) for _k, b, ps in (b0, b1, b2)]
    assert len(log) == 3  # without a site: one flat gather per block, none issued early
    log.clear()
    assert _equal(gather_locals(b0[1], b0[2], (pf, 0)), want[0])
    assert len(log) == 2 and list(pf.inflight) == [1]  # its own, and block 1's
    pf.issue_neighbour(0)  # already in flight: not issued again
    assert len(log) == 2 and pf.stats == {"issued": 1, "used": 0, "stale": 0}
    got = gather_locals(b1[1], b1[2], (pf, 1))
    assert _equal(got, want[1])
    assert len(log) == 3 and list(pf.inflight) == [2]  # block 1 gathered nothing itself
    assert _equal(gather_locals(b2[1], b2[2], (pf, 2)), want[2])
    assert len(log) == 3 and not pf.inflight  # the last block has no next one
    assert pf.stats == {"issued": 2, "used": 2, "stale": 0}


def test_a_prefetch_of_changed_shards_is_dropped(replicas):
    """Between the issue and the use an optimizer step may write the shards (in place: the
    version changes) or a load may replace them (another storage): the prefetched values
    are stale and must not be used."""
    log = replicas
    (b0, b1, _b2), pf = _three_blocks()
    for change in ("in place", "replaced"):
        gather_locals(b0[1], b0[2], (pf, 0))
        shard = b1[2][1]
        if change == "in place":
            shard._local_tensor.add_(1.0)
        else:
            shard._local_tensor = shard._local_tensor.clone()
        fresh = gather_locals(b1[1], b1[2], None)
        log.clear()
        assert _equal(gather_locals(b1[1], b1[2], (pf, 1)), fresh)
        assert len(log) == 2  # gathered afresh (and block 2's issued)
        pf.inflight.clear()
    assert pf.stats == {"issued": 4, "used": 0, "stale": 2}


def test_in_backward_the_previous_blocks_gather_is_issued(replicas):
    """Backward re-gathers the blocks in reverse order, so there the block that runs next is
    the previous one; the first block has none."""
    (_b0, b1, _b2), pf = _three_blocks()
    issued = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            for pos in (1, 0):
                pf.issue_neighbour(pos)
                issued.append(sorted(pf.inflight))
            return g

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert issued == [[0], [0]]
    pf.inflight.clear()
    pf.issue_neighbour(1)  # outside backward: forward order
    assert sorted(pf.inflight) == [2]
    assert pf.take(2, _b2[2]) is not None and pf.take(2, _b2[2]) is None  # used once


def test_only_the_first_gather_step_is_prefetched(replicas):
    """A member sharded over two data axes is gathered in two steps, the inner mesh dim
    first; only that step is issued early, the outer one is gathered when used."""
    log = replicas
    mesh = fake_mesh((2, 2))
    specs = [((S0, S1), (4, 6)), ((R, S0), (2, 3)), ((S1, R), (3, 4))]
    blocks = [_block(mesh, specs, seed) for seed in range(2)]
    inner, outer = (mesh.get_group(i).group_name for i in (1, 0))
    want = gather_locals(blocks[1][1], blocks[1][2], None)
    assert [t.shape for t in want] == [(4, 6), (2, 3), (3, 4)]
    pf = Prefetch()
    pf.link([k for k, _b, _ps in blocks], [lambda ps=ps: ps for _k, _b, ps in blocks])
    log.clear()
    gather_locals(blocks[0][1], blocks[0][2], (pf, 0))
    assert log == [inner, inner, outer]  # block 0's inner step, block 1's inner step, block 0's outer
    log.clear()
    assert _equal(gather_locals(blocks[1][1], blocks[1][2], (pf, 1)), want)
    assert log == [outer] and pf.stats == {"issued": 1, "used": 1, "stale": 0}


@pytest.mark.parametrize(
    "placements, sizes, want",
    [
        ((S0, S0), (2, 2), True),
        ((S0, R), (2, 1), True),  # a mesh dim of size 1 may be replicated
        ((S0, S1), (2, 1), True),
        ((S0, P), (2, 1), False),  # but not partial
        ((S0, R), (2, 2), False),  # a dim of size > 1 must split the rows
        ((S1, S0), (2, 2), False),
        ((S0,), (2,), True),
    ],
)
def test_batch_sharded_means_rows_split_over_every_mesh_dim(placements, sizes, want):
    mesh = fake_mesh(sizes)
    shape = (8, 4)
    x = DTensor.from_local(torch.zeros(2, 4), mesh, placements, run_check=False, shape=torch.Size(shape), stride=(4, 1))
    assert bucket.batch_sharded(x, sizes) is want
    assert bucket.batch_sharded(x, sizes + (1,)) is False  # not this mesh
    dist.destroy_process_group()


def test_batch_sharded_needs_a_dtensor_with_rows():
    mesh = fake_mesh((2,))
    assert not bucket.batch_sharded(torch.zeros(4, 2), (2,))
    scalar = DTensor.from_local(torch.zeros(()), mesh, (R,), run_check=False)
    assert not bucket.batch_sharded(scalar, (1,))
    rows = DTensor.from_local(torch.zeros(3), mesh, (S0,), run_check=False, shape=torch.Size((6,)), stride=(1,))
    assert bucket.batch_sharded(rows, (2,))  # one value per row is rows too
    dist.destroy_process_group()


def test_wrap_local_gives_the_batch_sharded_dtensor_of_these_rows():
    mesh = fake_mesh((2, 1))
    x = torch.arange(6.0).reshape(3, 2)
    y = bucket.wrap_local(x, mesh, (2, 1), (S0, R))
    assert isinstance(y, DTensor) and tuple(y.placements) == (S0, R)
    assert y.shape == (6, 2) and y.stride() == (2, 1) and torch.equal(y._local_tensor, x)
    v = bucket.wrap_local(torch.arange(3.0), mesh, (2, 1), (S0, R))  # rows only
    assert v.shape == (6,)
    assert bucket.wrap_local(y, mesh, (2, 1), (S0, R)) is y  # already a DTensor
    assert bucket.wrap_local("tag", mesh, (2, 1), (S0, R)) == "tag"
    with pytest.raises(AnnotationError) as e:
        bucket.wrap_local(torch.tensor(1.0), mesh, (2, 1), (S0, R))
    assert str(e.value) == (
        "a block returned a 0-d tensor while running on local rows (NOTE [local blocks] in "
        "meshlm/runtime/bucket/__init__.py): blocks must return batch-first activations"
    )
    dist.destroy_process_group()


def test_a_model_without_linked_blocks_prefetches_nothing(replicas):
    pf = Prefetch()
    pf.issue_neighbour(0)
    assert not pf.inflight and pf.take(0, []) is None and pf.stats == {"issued": 0, "used": 0, "stale": 0}
