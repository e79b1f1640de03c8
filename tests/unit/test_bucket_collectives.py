"""meshlm.runtime.bucket's flat collectives on simulated ranks (harness.simworld: the ranks of a
mesh as threads, the collectives as exchanges among them), against the layout the placements
mean: every rank's result must be its block of the global tensor (or of the sum over ranks)
under the target placements.  Values are small integers, so sums are exact in any order and
any dtype checked, and results are compared bit for bit."""

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from harness.simworld import SimWorld, locals_of, shares_storage
from meshlm.runtime import bucket

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.fixture(params=[True, False], ids=["eager", "traced"])
def eager(request, monkeypatch):
    monkeypatch.setattr(bucket.flat, "eager", lambda: request.param)
    return request.param


def _ints(shape, dtype, gen):
    return torch.randint(-8, 9, tuple(shape), generator=gen).to(dtype)


@st.composite
def _tensors(draw, n):
    """(global shapes, the dim each is split along, dtypes, seed): dims divisible by n."""
    k = draw(st.integers(1, 4))
    shapes, dims = [], []
    for _ in range(k):
        shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        d = draw(st.integers(0, len(shape) - 1))
        shape[d] *= n
        shapes.append(shape)
        dims.append(d)
    dtype = draw(st.sampled_from(DTYPES))
    return shapes, dims, dtype, draw(st.integers(0, 2**16))


# --------------------------------------------------------------------------- _gather_flat
@SETTINGS
@given(st.integers(1, 4), st.data())
def test_gather_flat_puts_each_ranks_block_at_its_offset(eager, monkeypatch, n, data):
    shapes, dims, dtype, seed = data.draw(_tensors(n))
    gen = torch.Generator().manual_seed(seed)
    full = [_ints(s, dtype, gen) for s in shapes]
    into = data.draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
    prefetched = data.draw(st.booleans())
    world = SimWorld([n], ["g"])
    world.patch(monkeypatch)

    def rank(r, _c):
        xs = [t.chunk(n, d)[r] for t, d in zip(full, dims)]
        dst = [torch.empty_like(t) if ok else None for t, ok in zip(full, into)]
        issued = bucket.flat.issue_gather(xs, "g") if prefetched else None
        res = bucket.flat.gather_flat(xs, dims, "g", n, issued, into=dst if any(into) else None)
        return res, dst

    for r, (res, dst) in enumerate(world.run(rank)):
        assert len(world.log[r]) == 1 and world.log[r][0][0] == "all_gather"  # one collective, used once
        for j, (y, t) in enumerate(zip(res, full)):
            assert y.dtype == t.dtype and torch.equal(y, t), (r, j)
            if into[j]:
                assert y is dst[j]
        buf = world.gathered[r][0]
        if eager and len(full) > 1 and any(dims):  # every result copied out: no view keeps the buffer alive
            assert not any(shares_storage(y, buf) for y in res)
        if len(full) == 1 and dims == [0] and not into[0]:  # the buffer is the result: no copy
            assert shares_storage(res[0], buf)


def test_issue_gather_sends_one_tensor_as_it_is(monkeypatch):
    sent = []
    monkeypatch.setattr(
        bucket.flat.compat, "all_gather_single", lambda flat, dim, group: sent.append((flat, dim, group)) or flat
    )
    x, y = torch.arange(6.0).view(2, 3), torch.arange(3.0)
    bucket.flat.issue_gather([x], "g")
    bucket.flat.issue_gather([x, y], "g")
    (one, d1, g1), (two, d2, g2) = sent
    assert one.shape == (6,) and one.data_ptr() == x.data_ptr()  # no copy of a lone tensor
    assert torch.equal(two, torch.cat([x.flatten(), y])) and (d1, g1, d2, g2) == (0, "g", 0, "g")


# --------------------------------------------------------------------------- _reduce_scatter_flat
def _sum(ts):
    acc = ts[0].clone()
    for t in ts[1:]:
        acc += t
    return acc


@SETTINGS
@given(st.integers(1, 4), st.data())
def test_reduce_scatter_flat_keeps_each_ranks_block_of_the_sum(eager, monkeypatch, n, data):
    shapes, dims, dtype, seed = data.draw(_tensors(n))
    reduce_dtype = data.draw(st.sampled_from([None, torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(seed)
    grads = [[_ints(s, dtype, gen) for s in shapes] for _r in range(n)]
    world = SimWorld([n], ["g"])
    world.patch(monkeypatch)

    out = world.run(lambda r, _c: bucket.flat.reduce_scatter_flat(grads[r], dims, "g", n, dtype=reduce_dtype))
    want_dtype = reduce_dtype or dtype
    for r, res in enumerate(out):
        assert [e[0] for e in world.log[r]] == ["reduce_scatter"] and world.log[r][0][4] == want_dtype
        for j, y in enumerate(res):
            total = _sum([grads[q][j].to(want_dtype) for q in range(n)])
            assert y.dtype == want_dtype and torch.equal(y, total.chunk(n, dims[j])[r]), (r, j)


# --------------------------------------------------------------------------- _all_reduce_flat
@SETTINGS
@given(st.integers(1, 3), st.data())
def test_all_reduce_flat_sums_without_touching_the_gradients(eager, monkeypatch, n, data):
    shapes, _dims, dtype, seed = data.draw(_tensors(1))
    reduce_dtype = data.draw(st.sampled_from([None, torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(seed)
    grads = [[_ints(s, dtype, gen) for s in shapes] for _r in range(n)]
    before = [[g.clone() for g in gs] for gs in grads]
    world = SimWorld([n], ["g"])
    world.patch(monkeypatch)

    out = world.run(lambda r, _c: bucket.flat.all_reduce_flat(grads[r], "g", dtype=reduce_dtype))
    want_dtype = reduce_dtype or dtype
    fresh = len(shapes) > 1 or want_dtype != dtype  # the packing made a buffer of its own
    for r, res in enumerate(out):
        # eager: in place on a buffer of its own; otherwise the functional (out-of-place) op
        assert [e[0] for e in world.log[r]] == ["all_reduce_" if eager and fresh else "all_reduce"]
        for j, y in enumerate(res):
            total = _sum([grads[q][j].to(want_dtype) for q in range(n)])
            assert y.dtype == want_dtype and torch.equal(y, total), (r, j)
            assert torch.equal(grads[r][j], before[r][j]) and not shares_storage(y, grads[r][j])


# --------------------------------------------------------------------------- _flat_moves
SIZES = [(2,), (3,), (2, 2), (2, 3)]


@st.composite
def _moves(draw):
    """Tensors with placements and targets as the callers make them: a target per mesh dim
    (Shard or Replicate), reached from Partial (a reduction), from Shard (an all-gather) or
    already there, with NOTE [shard order] kept: no reduce-scatter below, and no all-gather
    above, a dim sharding the same tensor dim."""
    sizes = draw(st.sampled_from(SIZES))
    world = 1
    for s in sizes:
        world *= s
    cases = []
    for _ in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(1, 2))
        tg = [draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(ndim)])) for _ in sizes]
        src = [
            draw(st.sampled_from([t, Partial()] + ([Shard(d) for d in range(ndim)] if t == Replicate() else [])))
            for t in tg
        ]
        ok = all(
            not (isinstance(tg[i], Shard) and src[i] == Partial() and Shard(tg[i].dim) in src[i + 1 :])
            and not (isinstance(src[i], Shard) and tg[i] == Replicate() and src[i] in tg[i + 1 :])
            for i in range(len(sizes))
        )
        if ok:
            shape = [draw(st.integers(1, 2)) * world for _ in range(ndim)]
            cases.append(
                (
                    shape,
                    src,
                    tg,
                    draw(st.sampled_from([torch.float32, torch.bfloat16])),
                    draw(st.sampled_from([None, "a", "b"])),
                    draw(st.booleans()),
                )
            )
    return sizes, cases, draw(st.sampled_from([None, torch.float32])), draw(st.integers(0, 2**16))


@SETTINGS
@given(_moves())
def test_flat_moves_reach_the_target_layout(eager, monkeypatch, case):
    sizes, cases, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    groups = [f"g{i}" for i in range(len(sizes))]
    full = [_ints(shape, dt, gen) for shape, _s, _t, dt, _k, _i in cases]
    src = [locals_of(t, c[1], sizes, gen) for t, c in zip(full, cases)]
    want = [locals_of(t, c[2], sizes, gen) for t, c in zip(full, cases)]
    dims = range(len(sizes))
    order = [("rs", i) for i in dims] + [("ar", i) for i in dims] + [("ag", i) for i in reversed(dims)]
    world = SimWorld(sizes, groups)
    world.patch(monkeypatch)

    def rank(_r, c):
        xs = [s[c] for s in src]
        pls = [list(cs[1]) for cs in cases]
        into = {
            j: torch.empty(w[c].shape, dtype=dtype or cs[3] if Partial() in cs[1] else cs[3])
            for j, (w, cs) in enumerate(zip(want, cases))
            if cs[5]
        }
        keys = {j: cs[4] for j, cs in enumerate(cases) if cs[4] is not None}
        bucket.flat.flat_moves(
            xs, pls, [tuple(cs[2]) for cs in cases], sizes, groups, order, key=keys, into=into, dtype=dtype
        )
        return xs, pls, into

    for r, (xs, pls, into) in enumerate(world.run(rank)):
        c = world.coords[r]
        for j, (shape, s, t, dt, k, _i) in enumerate(cases):
            reduced = Partial() in s
            assert pls[j] == list(t), (r, j)
            assert xs[j].dtype == (dtype or dt if reduced else dt)
            assert torch.equal(xs[j], want[j][c].to(xs[j].dtype)), (r, j, s, t)
            gathered = any(isinstance(a, Shard) and b == Replicate() for a, b in zip(s, t))
            assert (j in into and xs[j] is into[j]) == (j in into and gathered), (r, j)
        # per chunk (the tensors of one key) and (kind, mesh dim): one collective per dtype of
        # the chunk's tensors that make that move (chunks overlap in flight: NOTE [reductions
        # in flight], so only the counts are fixed; a chunk's moves in the wrong order would
        # not reach the values above)
        want_log = Counter()
        for key in {k for *_x, k, _i in cases}:
            for kind, i in order:
                sig = set()
                for shape, s, t, dt, k, _i in cases:
                    moves = {
                        "rs": s[i] == Partial() and isinstance(t[i], Shard),
                        "ar": s[i] == Partial() and t[i] == Replicate(),
                        "ag": isinstance(s[i], Shard) and t[i] == Replicate(),
                    }[kind]
                    if moves and k == key:
                        sig.add(dtype or dt if kind != "ag" or Partial() in s else dt)
                want_log[(kind, groups[i])] += len(sig)
        kind_of = {"reduce_scatter": "rs", "all_reduce": "ar", "all_reduce_": "ar", "all_gather": "ag"}
        issued = Counter((kind_of[e[0]], e[1]) for e in world.log[r])
        assert issued == +want_log, (r, issued, want_log)


def test_flat_moves_leave_other_moves_and_skipped_tensors():
    """Moves not in ``order`` (and tensors given as None) are the caller's: untouched."""
    R, S0, P = Replicate(), Shard(0), Partial()
    x = torch.ones(4)
    xs, pls = [x, None], [[R], [P]]
    bucket.flat.flat_moves(xs, pls, [(S0,), (R,)], (2,), ("g",), [("rs", 0), ("ar", 0), ("ag", 0)])
    assert xs[0] is x and xs[1] is None and pls == [[R], [P]]
    xs, pls = [x], [[P]]
    bucket.flat.flat_moves(xs, pls, [(S0,)], (2,), ("g",), [("ar", 0), ("ag", 0)])
    assert xs[0] is x and pls == [[P]]


def test_flat_moves_share_a_collective_per_dtype_and_key(monkeypatch):
    """Tensors that make the same move share a collective unless their dtype or key differs;
    without keys, all of one dtype share one."""
    P, S0 = Partial(), Shard(0)
    world = SimWorld([2], ["g"])
    world.patch(monkeypatch)
    xs0 = [torch.ones(2, 2), torch.ones(4), torch.ones(2), torch.ones(2, dtype=torch.bfloat16)]

    def rank(_r, _c, key):
        xs, pls = list(xs0), [[P] for _ in xs0]
        bucket.flat.flat_moves(xs, pls, [(S0,)] * 4, (2,), ("g",), [("rs", 0)], key=key)
        return xs

    for key, n in (({0: "a", 1: "b"}, 4), (None, 2), ({}, 2), ({0: "a", 1: "a", 2: "a"}, 2)):
        world.log = [[] for _ in world.log]
        for xs in world.run(lambda r, c: rank(r, c, key)):
            assert [tuple(x.shape) for x in xs] == [(1, 2), (2,), (1,), (1,)]
            assert all(torch.equal(x, 2 * torch.ones_like(x)) for x in xs)
        assert [len(lg) for lg in world.log] == [n, n], key


def test_flat_moves_reduce_in_one_dtype_and_gather_in_each(monkeypatch):
    """With a reduce dtype, tensors of different dtypes are cast into one reduction buffer;
    an all-gather moves each dtype in its own buffer and keeps it."""
    P, R, S0 = Partial(), Replicate(), Shard(0)
    world = SimWorld([2], ["g"])
    world.patch(monkeypatch)
    f32, bf16 = torch.float32, torch.bfloat16

    def rank(r, _c, src):
        xs = [torch.full((2,), r + 1.0, dtype=f32), torch.full((2,), r + 1.0, dtype=bf16)]
        pls = [[src], [src]]
        bucket.flat.flat_moves(xs, pls, [(R,), (R,)], (2,), ("g",), [("ar", 0), ("ag", 0)], dtype=f32)
        return xs

    for xs in world.run(lambda r, c: rank(r, c, P)):  # a sum over ranks 1 + 2, both in float32
        assert [x.dtype for x in xs] == [f32, f32] and all(torch.equal(x, torch.full((2,), 3.0)) for x in xs)
    assert [[e[:1] + e[3:] for e in lg] for lg in world.log] == [[("all_reduce_", (4,), f32)]] * 2
    world.log = [[] for _ in world.log]
    for xs in world.run(lambda r, c: rank(r, c, S0)):  # [1, 1] | [2, 2] -> each in its own dtype
        assert [x.dtype for x in xs] == [f32, bf16] and all(x.tolist() == [1, 1, 2, 2] for x in xs)
    assert [[e[:1] + e[3:] for e in lg] for lg in world.log] == [
        [("all_gather", (2,), f32), ("all_gather", (2,), bf16)]
    ] * 2


def test_flat_moves_reduce_a_group_of_bf16_tensors_in_the_reduce_dtype(monkeypatch):
    """The reduce dtype holds for a group with no tensor of that dtype (the buffer's dtype
    is not the first tensor's): bf16 gradients are summed in float32, all-reduced and
    reduce-scattered alike."""
    P, R, S0 = Partial(), Replicate(), Shard(0)
    world = SimWorld([2], ["g"])
    world.patch(monkeypatch)
    f32, bf16 = torch.float32, torch.bfloat16

    def rank(r, _c, tg):
        xs = [torch.full((2,), r + 1.0, dtype=bf16), torch.full((4,), r + 1.0, dtype=bf16)]
        pls = [[P], [P]]
        bucket.flat.flat_moves(xs, pls, [(tg,), (tg,)], (2,), ("g",), [("rs", 0), ("ar", 0)], dtype=f32)
        return xs

    for tg, op, shapes in ((R, "all_reduce_", [(2,), (4,)]), (S0, "reduce_scatter", [(1,), (2,)])):
        world.log = [[] for _ in world.log]
        for xs in world.run(lambda r, c: rank(r, c, tg)):
            assert [x.dtype for x in xs] == [f32, f32] and [tuple(x.shape) for x in xs] == shapes
            assert all(torch.equal(x, torch.full_like(x, 3.0)) for x in xs)
        assert [(e[0], e[4]) for lg in world.log for e in lg] == [(op, f32)] * 2, world.log


def test_sim_world_refuses_mismatched_collectives(monkeypatch):
    """The simulation is strict: ranks that issue different collectives fail the test."""
    world = SimWorld([2], ["g"])
    world.patch(monkeypatch)
    with pytest.raises(AssertionError):
        world.run(lambda r, _c: bucket.flat.compat.all_gather_single(torch.zeros(r + 1), 0, "g"))
    assert list(itertools.chain(*world.log))  # it did run
