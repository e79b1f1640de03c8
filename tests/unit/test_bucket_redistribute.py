"""``bucket.redistribute_flat`` (the optimizer's ZeRO reduce-scatter of gradients and
all-gather of updates) on simulated ranks (meshlm.testing.simworld) over a fake process
group's mesh, against what the placements mean: every result is the block its target
placement gives of the tensor the inputs stand for; ``into`` receives its result in place
and is what is returned; a tensor already at its target comes back as it is; a move no flat
collective makes is left to DTensor and still reaches the target.  And ``is_sum_partial``,
which decides what the flat reductions may sum.  Values are small integers, compared bit for
bit."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm import bucket
from meshlm._torch_compat import torch_at_least
from meshlm.bucket.flat import is_sum_partial
from meshlm.testing.simworld import SimWorld, fake_mesh, locals_of

R, P = Replicate(), Partial()
S0, S1 = Shard(0), Shard(1)
f32, bf16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _ints(shape, dtype, gen):
    return torch.randint(-8, 9, tuple(shape), generator=gen).to(dtype)


def test_only_a_sum_partial_is_summed_by_the_flat_reductions():
    """An average or max Partial must not be summed by a flat collective (its ranks' values
    would be added up): those moves are DTensor's."""
    assert is_sum_partial(Partial()) and is_sum_partial(Partial("sum"))
    assert not is_sum_partial(Partial("avg")) and not is_sum_partial(Partial("max"))
    assert not is_sum_partial(R) and not is_sum_partial(S0)


# (source placements, target placements, shape, dtype, given an ``into``)
CASES = [
    ((P, P), (S0, S1), (4, 6), f32, False),  # reduce-scatter over both dims (ZeRO-2 gradients)
    ((P, R), (R, R), (3,), bf16, False),  # all-reduce over dim 0
    ((S0, S1), (R, R), (4, 2), f32, True),  # all-gather of an update into the parameter
    ((R, S0), (R, R), (6, 2), bf16, True),  # over one dim, another dtype, into
    ((S0, R), (S0, R), (4,), f32, True),  # already at its target
]


@pytest.mark.skipif(
    not torch_at_least(2, 13),
    reason="torch < 2.13: DTensor ops on SimWorld's threads crash in its fake-tensor shape propagation",
)
@pytest.mark.parametrize("keys", [None, ["a", "a", "b", "b", "a"]], ids=["no-keys", "keys"])
def test_each_result_is_its_targets_block_in_place_where_asked(monkeypatch, keys):
    sizes = (2, 2)
    mesh = fake_mesh(sizes)
    groups = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    world = SimWorld(sizes, groups)
    world.patch(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    full = [_ints(shape, dt, gen) for _s, _t, shape, dt, _i in CASES]
    src = [locals_of(t, c[0], sizes, gen) for t, c in zip(full, CASES)]
    want = [locals_of(t, c[1], sizes, gen) for t, c in zip(full, CASES)]

    def rank(_r, c):
        ts = [
            DTensor.from_local(s[c], mesh, cs[0], run_check=False, shape=cs[2], stride=f.stride())
            for s, cs, f in zip(src, CASES, full)
        ]
        into = [
            DTensor.from_local(torch.empty_like(w[c]), mesh, cs[1], run_check=False, shape=cs[2], stride=f.stride())
            if cs[4]
            else None
            for w, cs, f in zip(want, CASES, full)
        ]
        return ts, into, bucket.redistribute_flat(ts, [cs[1] for cs in CASES], keys, into=into)

    for r, (ts, into, out) in enumerate(world.run(rank)):
        c = world.coords[r]
        for j, (s, t, shape, dt, given) in enumerate(CASES):
            assert tuple(out[j].placements) == t and tuple(out[j].shape) == shape and out[j].dtype == dt, (r, j)
            assert torch.equal(out[j].to_local(), want[j][c]), (r, j, s, t)
            if s == t:
                assert out[j] is ts[j]
            elif given:
                assert out[j] is into[j], (r, j)  # written in place, no second buffer
        # reduce-scatters outer dim first, the all-reduce, then all-gathers inner dim first: one
        # collective per dim and dtype (over dim 1, the f32 and the bf16 gather apart)
        assert [(op.rstrip("_"), groups.index(g)) for op, g, *_ in world.log[r]] == [
            ("reduce_scatter", 0),
            ("reduce_scatter", 1),
            ("all_reduce", 0),
            ("all_gather", 1),
            ("all_gather", 1),
            ("all_gather", 0),
        ], world.log[r]


def test_a_move_no_flat_collective_makes_is_left_to_dtensor():
    """One tensor (no second to take the mesh from) whose move is not a flat one on a
    one-rank mesh: DTensor's redistribute still takes it to its target; no keys given."""
    mesh = fake_mesh((1,))
    x = torch.arange(6.0).reshape(2, 3)
    t = DTensor.from_local(x, mesh, (S0,), run_check=False)
    [out] = bucket.redistribute_flat([t], [(S1,)])
    assert tuple(out.placements) == (S1,) and torch.equal(out.to_local(), x)
    [out] = bucket.redistribute_flat([t], [(R,)])
    assert tuple(out.placements) == (R,) and torch.equal(out.to_local(), x)
    assert bucket.redistribute_flat([], []) == []
