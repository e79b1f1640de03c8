"""A block bucket's gather (``gather_locals``, ``Gather.forward``) and gradient reduction
(``Gather.backward``) on simulated ranks (harness.simworld), against the layout the
placements mean: the gathered parameters must be their compute blocks, and each gradient
its block, under the layout's ``grads`` placements, of the sum over every rank's gradient.
The DTensors live on a fake process group's mesh (metadata only): any collective the
bucket leaves to DTensor would not reduce, so the results show it too.  And the
optimizer's flat collectives (``redistribute_flat``: its ZeRO reduce-scatter of gradients and
all-gather of updates) the same way, with ``is_sum_partial``, which decides what the flat
reductions may sum.  Values are small integers: sums are exact in any order, results
compared bit for bit."""

import threading
import weakref
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.simworld import SimWorld, fake_mesh, locals_of, shares_storage
from meshlm._torch_compat import torch_at_least
from meshlm.core.state import RUN, counting
from meshlm.runtime import bucket
from meshlm.runtime.bucket.flat import is_sum_partial

# These run DTensor ops on the threads of a SimWorld; torch 2.11's DTensor shape propagation
# (its FakeTensorMode) crashes off the main thread.  The library runs one rank per process.
pytestmark = pytest.mark.skipif(
    not torch_at_least(2, 13),
    reason="torch < 2.13: DTensor ops on SimWorld's threads crash in its fake-tensor shape propagation",
)

R, P = Replicate(), Partial()
S0, S1 = Shard(0), Shard(1)
f32, bf16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class _Ctx(SimpleNamespace):
    """An autograd Function's ctx, as far as ``Gather`` uses one."""

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _ints(shape, dtype, gen):
    return torch.randint(-8, 9, tuple(shape), generator=gen).to(dtype)


def _bucket(mesh, sizes, data_dims, specs, local, compute_dtype=None, reduce_dtype=None, grad_dtype=None):
    """specs: (storage, compute, grads, shape, dtype) per member."""
    members = tuple(bucket.member(s, c, g, shape, dt, data_dims) for s, c, g, shape, dt in specs)
    assert all(m is not None for m in members)
    b = bucket.Bucket(
        mesh=mesh,
        groups=tuple(f"g{i}" for i in range(len(sizes))),
        sizes=tuple(sizes),
        data_dims=tuple(data_dims),
        members=members,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        local=local,
        grad_dtype=grad_dtype,
    )
    return bucket.register(b, mesh), b  # held while the mesh lives


# Data-parallel blocks (every mesh dim a data axis): FSDP, HSDP, DDP, ZeRO-1 and 2-D FSDP members.
DATA_SPECS = [
    ((S0, S0), (R, R), (S0, S0), (8, 3), f32),  # sharded over both (outer dim first)
    ((R, S1), (R, R), (R, S1), (2, 4), f32),  # HSDP: sharded over the inner, replicated over the outer
    ((R, R), (R, R), (R, R), (5,), f32),  # DDP
    ((R, S0), (R, R), None, (4, 2), f32),  # ZeRO-1: gradients left Partial (local)
    ((S1, R), (R, R), (S1, R), (3, 2), bf16),  # another dtype: its own flat buffers
]


@pytest.mark.parametrize("reduce_dtype", [None, f32])
@pytest.mark.parametrize("compute_dtype", [None, bf16])
def test_gather_then_reduce_on_local_rows(monkeypatch, compute_dtype, reduce_dtype):
    sizes = (2, 2)
    mesh = fake_mesh(sizes)
    key, b = _bucket(
        mesh, sizes, (0, 1), DATA_SPECS, local=True, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype
    )
    gen = torch.Generator().manual_seed(0)
    full = [_ints(m.shape, m.dtype, gen) for m in b.members]
    stored = [locals_of(t, m.storage, sizes, gen) for t, m in zip(full, b.members)]
    world = SimWorld(sizes, b.groups)
    world.patch(monkeypatch)
    grads = [[_ints(m.shape, m.dtype, gen) for m in b.members] for _ in range(world.world)]

    def rank(r, c):
        params = [SimpleNamespace(_local_tensor=s[c]) for s in stored]
        ctx = _Ctx()
        ys = bucket.Gather.forward(ctx, key, True, *params)
        n_fwd = len(world.log[r])
        out = bucket.Gather.backward(ctx, *grads[r])
        return ys, out, n_fwd

    for r, (ys, out, n_fwd) in enumerate(world.run(rank)):
        c = world.coords[r]
        assert out[:2] == (None, None)
        # the DDP member does not move: never its stored tensor itself (an alias of it, or a cast)
        assert ys[2] is not stored[2][c] and shares_storage(ys[2], stored[2][c]) == (compute_dtype is None)
        for j, (m, y, g) in enumerate(zip(b.members, ys, out[2:])):
            # forward: the whole parameter in the compute dtype, a plain tensor
            assert not isinstance(y, DTensor) and torch.equal(y, full[j].to(compute_dtype or m.dtype)), (r, j)
            # backward: the sum over the ranks in the grads placements, in the parameter's dtype
            total = sum(grads[q][j].to(f32) for q in range(world.world))
            assert isinstance(g, DTensor) and g.dtype == m.dtype and g.shape == m.shape, (r, j)
            if m.grads is None:  # ZeRO-1: this rank's share, still Partial
                assert tuple(g.placements) == (P, P) and torch.equal(g._local_tensor, grads[r][j])
                continue
            assert tuple(g.placements) == m.grads
            assert torch.equal(g._local_tensor, locals_of(total, m.grads, sizes, gen)[c].to(m.dtype)), (r, j)
        # one gather per mesh dim and dtype (inner first), then the reductions in the reduce dtype
        fwd, bwd = world.log[r][:n_fwd], world.log[r][n_fwd:]
        # (over g1: members 0, 1, 3; over g0: members 0 and 4, one buffer per dtype)
        assert [(op, g) for op, g, *_ in fwd] == [("all_gather", "g1")] + [("all_gather", "g0")] * (
            1 if compute_dtype else 2
        )
        assert {e[4] for e in fwd} == ({compute_dtype} if compute_dtype else {f32, bf16})
        # (a buffer per route: the members reduced the same way share one; here none do; routes
        # overlap in flight, NOTE [reductions in flight], so only the counts are fixed)
        assert Counter((op.rstrip("_"), g) for op, g, *_ in bwd) == {
            ("reduce_scatter", "g0"): 2,
            ("reduce_scatter", "g1"): 2,
            ("all_reduce", "g0"): 2,
            ("all_reduce", "g1"): 2,
        }
        assert {e[4] for e in bwd} == ({reduce_dtype} if reduce_dtype else {f32, bf16})


# A DTensor block on an (fsdp, tp) mesh: only dim 0 is a data axis; tp stays as it is stored.
TP_SPECS = [
    ((S0, S1), (R, S1), (S0, S1), (4, 6), f32),  # a column of the tp split, rows over fsdp
    ((S1, S0), (R, S0), (S1, S0), (4, 6), f32),  # rows over tp, columns over fsdp
    ((S0, R), (R, R), (S0, R), (6,), f32),  # a norm weight, Partial over tp under SP
]


def test_gather_a_dtensor_block_to_its_compute_placements(monkeypatch):
    """A DTensor block's forward: each parameter a DTensor on the bucket's mesh in its compute
    placements, global shape and stride, holding its compute block; a parameter that does not
    move is a fresh alias of its stored tensor, not that tensor.  The run state's ``gathering`` counts this
    gather while it runs (the re-gathering checkpoint policy reads it), on top of any other
    already running, and is back where it was after."""
    sizes = (2, 2)
    mesh = fake_mesh(sizes)
    specs = TP_SPECS + [((R, S1), (R, S1), (R, S1), (2, 4), f32)]  # stored as computed: nothing moves
    key, b = _bucket(mesh, sizes, (0,), specs, local=False)
    gen = torch.Generator().manual_seed(4)
    full = [_ints(m.shape, m.dtype, gen) for m in b.members]
    stored = [locals_of(t, m.storage, sizes, gen) for t, m in zip(full, b.members)]
    world = SimWorld(sizes, b.groups)
    world.patch(monkeypatch)
    seen = []
    real = bucket.op.gather_locals
    monkeypatch.setattr(bucket.op, "gather_locals", lambda *a, **k: seen.append(RUN.gathering) or real(*a, **k))

    def rank(_r, c):
        params = [
            DTensor.from_local(s[c], mesh, m.storage, run_check=False, shape=m.shape, stride=m.stride)
            for s, m in zip(stored, b.members)
        ]
        return params, bucket.Gather.forward(_Ctx(), key, False, *params)

    with counting("gathering", 2):  # as if two other gathers were running (the ranks' threads share it)
        results = world.run(rank)
        after = RUN.gathering
    for r, (params, ys) in enumerate(results):
        c = world.coords[r]
        for j, (m, p, y) in enumerate(zip(b.members, params, ys)):
            assert isinstance(y, DTensor) and tuple(y.placements) == m.compute and y.device_mesh is mesh, (r, j)
            assert tuple(y.shape) == m.shape and y.stride() == m.stride and y.dtype == m.dtype, (r, j)
            assert torch.equal(y._local_tensor, locals_of(full[j], m.compute, sizes, gen)[c]), (r, j)
        assert ys[-1]._local_tensor is not params[-1]._local_tensor
        assert shares_storage(ys[-1]._local_tensor, params[-1]._local_tensor)
    assert len(seen) == world.world and 3 <= min(seen) and max(seen) <= 2 + world.world and after == 2


def test_reduce_a_dtensor_blocks_gradients_over_data_then_other_axes(monkeypatch):
    sizes = (2, 2)
    mesh = fake_mesh(sizes)
    key, b = _bucket(mesh, sizes, (0,), TP_SPECS, local=False, reduce_dtype=f32)
    gen = torch.Generator().manual_seed(1)
    full = [_ints(m.shape, m.dtype, gen) for m in b.members]
    arrive = [(P, S1), (P, S0), (P, P)]  # what DTensor's backward hands the gather
    parts = [locals_of(t, pl, sizes, gen) for t, pl in zip(full, arrive)]
    world = SimWorld(sizes, b.groups)
    world.patch(monkeypatch)

    def rank(_r, c):
        gs = [
            DTensor.from_local(p[c], mesh, pl, run_check=False, shape=m.shape, stride=m.stride)
            for p, pl, m in zip(parts, arrive, b.members)
        ]
        return bucket.Gather.backward(_Ctx(key=key, local=False, params=(), fill=None), *gs)

    for r, out in enumerate(world.run(rank)):
        c = world.coords[r]
        for j, (m, g) in enumerate(zip(b.members, out[2:])):
            assert tuple(g.placements) == m.grads and g.dtype == m.dtype, (r, j)
            assert torch.equal(g._local_tensor, locals_of(full[j], m.grads, sizes, gen)[c]), (r, j)
        # one reduce-scatter over fsdp for the two weights, one for the norm weight (another
        # route), then the norm weight's all-reduce over tp on its scattered shard
        assert [(op.rstrip("_"), g, shape) for op, g, _x, shape, _dt in world.log[r]] == [
            ("reduce_scatter", "g0", (12 + 12,)),
            ("reduce_scatter", "g0", (6,)),
            ("all_reduce", "g1", (3,)),
        ]


def test_a_missing_gradient_and_a_move_no_flat_collective_makes(monkeypatch):
    """A member without a gradient (a parameter the block did not use) gets None and the
    others still theirs; a gradient that arrives already summed (Replicate) reaches its
    Shard target per parameter, cast through the reduce dtype back to its own."""
    sizes = (2,)
    mesh = fake_mesh(sizes)
    specs = [((S0,), (R,), (S0,), (4, 2), f32), ((S0,), (R,), (S0,), (4, 2), f32), ((S0,), (R,), (S0,), (6,), bf16)]
    key, b = _bucket(mesh, sizes, (0,), specs, local=False, reduce_dtype=f32)
    gen = torch.Generator().manual_seed(3)
    full = [_ints(m.shape, m.dtype, gen) for m in b.members]
    arrive = [None, (P,), (R,)]
    parts = [locals_of(t, pl, sizes, gen) if pl else None for t, pl in zip(full, arrive)]
    world = SimWorld(sizes, b.groups)
    world.patch(monkeypatch)

    def rank(_r, c):
        gs = [
            DTensor.from_local(p[c], mesh, pl, run_check=False, shape=m.shape, stride=m.stride) if pl else None
            for p, pl, m in zip(parts, arrive, b.members)
        ]
        return bucket.Gather.backward(_Ctx(key=key, local=False, params=(), fill=None), *gs)

    for r, out in enumerate(world.run(rank)):
        assert out[:3] == (None, None, None), r
        for j in (1, 2):
            g, m = out[2 + j], b.members[j]
            assert tuple(g.placements) == m.grads and g.dtype == m.dtype, (r, j)
            # DTensor's own redistribute (member 2) takes the block of the fake group's rank,
            # which is 0 on every thread
            c = (r,) if j == 1 else (0,)
            assert torch.equal(g._local_tensor, locals_of(full[j], m.grads, sizes, gen)[c]), (r, j)
        assert [(op, shape) for op, _g, _x, shape, _dt in world.log[r]] == [("reduce_scatter", (8,))]


@pytest.mark.parametrize("reduce_dtype", [f32, bf16])
def test_main_grads_take_the_reduced_gradient_in_their_dtype(monkeypatch, reduce_dtype):
    """float32 main gradients of bf16 parameters, whether the reduction sums in float32 or
    in bf16 (exact here: small integers)."""
    sizes = (2,)
    mesh = fake_mesh(sizes)
    specs = [((S0,), (R,), (S0,), (4, 2), bf16), ((R,), (R,), (R,), (3,), bf16)]
    key, b = _bucket(mesh, sizes, (0,), specs, local=True, reduce_dtype=reduce_dtype, grad_dtype=f32)
    gen = torch.Generator().manual_seed(2)
    grads = [[_ints(m.shape, m.dtype, gen) for m in b.members] for _ in range(2)]
    world = SimWorld(sizes, b.groups)
    world.patch(monkeypatch)

    def rank(_r, _c):
        params = [SimpleNamespace() for _ in specs]
        for _step in range(2):  # main gradients accumulate across backward passes
            out = bucket.Gather.backward(_Ctx(key=key, local=True, params=params, fill=None), *grads[_r])
            assert out == (None,) * 4  # nothing to autograd
        return params

    for r, params in enumerate(world.run(rank)):
        for j, (m, p) in enumerate(zip(b.members, params)):
            total = 2 * sum(grads[q][j].to(f32) for q in range(2))
            assert p.main_grad.dtype == f32 and tuple(p.main_grad.placements) == m.grads
            assert torch.equal(p.main_grad._local_tensor, locals_of(total, m.grads, sizes, gen)[(r,)]), (r, j)


# --------------------------------------------------------------------------- redistribute_flat
def test_only_a_sum_partial_is_summed_by_the_flat_reductions():
    """An average or max Partial must not be summed by a flat collective (its ranks' values
    would be added up): those moves are DTensor's."""
    assert is_sum_partial(Partial()) and is_sum_partial(Partial("sum"))
    assert not is_sum_partial(Partial("avg")) and not is_sum_partial(Partial("max"))
    assert not is_sum_partial(R) and not is_sum_partial(S0)


# (source placements, target placements, shape, dtype, given an ``into``)
FLAT_CASES = [
    ((P, P), (S0, S1), (4, 6), f32, False),  # reduce-scatter over both dims (ZeRO-2 gradients)
    ((P, R), (R, R), (3,), bf16, False),  # all-reduce over dim 0
    ((S0, S1), (R, R), (4, 2), f32, True),  # all-gather of an update into the parameter
    ((R, S0), (R, R), (6, 2), bf16, True),  # over one dim, another dtype, into
    ((S0, R), (S0, R), (4,), f32, True),  # already at its target
]


@pytest.mark.parametrize("keys", [None, ["a", "a", "b", "b", "a"]], ids=["no-keys", "keys"])
def test_each_result_is_its_targets_block_in_place_where_asked(monkeypatch, keys):
    sizes = (2, 2)
    mesh = fake_mesh(sizes)
    groups = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    world = SimWorld(sizes, groups)
    world.patch(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    full = [_ints(shape, dt, gen) for _s, _t, shape, dt, _i in FLAT_CASES]
    src = [locals_of(t, c[0], sizes, gen) for t, c in zip(full, FLAT_CASES)]
    want = [locals_of(t, c[1], sizes, gen) for t, c in zip(full, FLAT_CASES)]

    def rank(_r, c):
        ts = [
            DTensor.from_local(s[c], mesh, cs[0], run_check=False, shape=cs[2], stride=f.stride())
            for s, cs, f in zip(src, FLAT_CASES, full)
        ]
        into = [
            DTensor.from_local(torch.empty_like(w[c]), mesh, cs[1], run_check=False, shape=cs[2], stride=f.stride())
            if cs[4]
            else None
            for w, cs, f in zip(want, FLAT_CASES, full)
        ]
        return ts, into, bucket.redistribute_flat(ts, [cs[1] for cs in FLAT_CASES], keys, into=into)

    for r, (ts, into, out) in enumerate(world.run(rank)):
        c = world.coords[r]
        for j, (s, t, shape, dt, given) in enumerate(FLAT_CASES):
            assert tuple(out[j].placements) == t and tuple(out[j].shape) == shape and out[j].dtype == dt, (r, j)
            assert torch.equal(out[j].to_local(), want[j][c]), (r, j, s, t)
            if s == t:
                assert out[j] is ts[j]
            elif given:
                assert out[j] is into[j], (r, j)  # written in place, no second buffer
        # reduce-scatters outer dim first, the all-reduce, then all-gathers inner dim first: one
        # collective per dim and dtype (over dim 1, the f32 and the bf16 gather apart)
        log = [(op.rstrip("_"), groups.index(g)) for op, g, *_ in world.log[r]]
        if keys is None:
            assert log == [
                ("reduce_scatter", 0),
                ("reduce_scatter", 1),
                ("all_reduce", 0),
                ("all_gather", 1),
                ("all_gather", 1),
                ("all_gather", 0),
            ], world.log[r]
        else:
            # chunk "a" (0, 1, 4) in that order, and chunk "b" (2, 3) issued while a's first
            # reduce-scatter is in flight (NOTE [reductions in flight]); b's last move once a is done
            assert log == [
                ("reduce_scatter", 0),
                ("all_gather", 1),
                ("all_gather", 1),
                ("reduce_scatter", 1),
                ("all_reduce", 0),
                ("all_gather", 0),
            ], world.log[r]


@pytest.mark.parametrize("consume", [True, False])
def test_consumed_tensors_go_as_their_collective_reads_them(monkeypatch, consume):
    """``redistribute_flat(..., consume=True)``, as the optimizer reduces its main gradients:
    each tensor that moves is taken out of the caller's list, so that its memory goes once
    its chunk's collective has read it (packed it), not when the call returns, nor when the
    chunk lands.  Three chunks of two tensors: the first chunk's are gone before the second
    chunk's reduce-scatter is issued (both are in flight together, NOTE [reductions in
    flight]); kept (``consume=False``), all outlive every collective.  The results are the
    sums either way."""
    sizes = (2,)
    mesh = fake_mesh(sizes)
    world = SimWorld(sizes, [mesh.get_group(0).group_name])
    world.patch(monkeypatch)
    grads = [[_ints((4, 2), f32, torch.Generator().manual_seed(10 * r + j)) for j in range(6)] for r in range(2)]

    def rank(r, c):
        ts = [DTensor.from_local(g.clone(), mesh, (P,), run_check=False, shape=(4, 2), stride=(2, 1)) for g in grads[r]]
        for j, t in enumerate(ts):
            weakref.finalize(t._local_tensor, world.log[r].append, ("freed", j))
        out = bucket.redistribute_flat(ts, [(S0,)] * 6, [0, 0, 1, 1, 2, 2], consume=consume)
        events = [e[0] if e[0] != "freed" else e for e in world.log[r]]
        return events, [t is None for t in ts], [o.to_local().clone() for o in out]

    for r, (events, gone, out) in enumerate(world.run(rank)):
        for j in range(6):
            assert torch.equal(out[j], (grads[0][j] + grads[1][j])[2 * r : 2 * r + 2]), (r, j)
        second = [k for k, e in enumerate(events) if e == "reduce_scatter"][1]
        freed_first = [k for k, e in enumerate(events) if e in (("freed", 0), ("freed", 1))]
        if consume:
            assert all(gone) and len(freed_first) == 2 and max(freed_first) < second, events
        else:
            assert not any(gone) and not freed_first, events


def test_two_chunks_in_flight_at_most(monkeypatch):
    """NOTE [reductions in flight]: five chunks' reduce-scatters, each issued before the one
    before it is waited for, and never more than two in flight at once (a bound on the
    buffers held, each no larger than a chunk)."""
    sizes = (2,)
    mesh = fake_mesh(sizes)
    world = SimWorld(sizes, [mesh.get_group(0).group_name])
    world.patch(monkeypatch)
    flight: dict = {}
    most: dict = {}
    issue, land = bucket.flat.issue_reduce_scatter, bucket.flat.land

    def counted_issue(*a, **k):
        t = threading.get_ident()
        flight[t] = flight.get(t, 0) + 1
        most[t] = max(most.get(t, 0), flight[t])
        return issue(*a, **k)

    def counted_land(*a, **k):
        flight[threading.get_ident()] -= 1
        return land(*a, **k)

    monkeypatch.setattr(bucket.flat, "issue_reduce_scatter", counted_issue)
    monkeypatch.setattr(bucket.flat, "land", counted_land)
    grads = [[_ints((4, 2), f32, torch.Generator().manual_seed(10 * r + j)) for j in range(5)] for r in range(2)]

    def rank(r, c):
        ts = [DTensor.from_local(g, mesh, (P,), run_check=False, shape=(4, 2), stride=(2, 1)) for g in grads[r]]
        out = bucket.redistribute_flat(ts, [(S0,)] * 5, [0, 1, 2, 3, 4])
        assert all(t is not None for t in ts)  # not consumed unless asked
        return [o.to_local().clone() for o in out]

    for r, out in enumerate(world.run(rank)):
        for j in range(5):
            assert torch.equal(out[j], (grads[0][j] + grads[1][j])[2 * r : 2 * r + 2]), (r, j)
    assert len(most) == 2 and set(most.values()) == {2} and set(flight.values()) == {0}, (most, flight)


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
