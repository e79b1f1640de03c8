"""meshlm.runtime.bucket's helpers that decide numbers, in one process, against independent references:
which parameters a bucket gathers and how (``member``, ``_gather_steps``), where a gradient
ends (``_target``), how tensors are grouped into flat buffers (``_groups``), and how they are
packed into and cut out of them (``_pack``, ``_split``), eager and traced.  The collectives
themselves, on simulated ranks: tests/unit/test_bucket_collectives.py."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from harness.simworld import shares_storage
from meshlm.runtime import bucket

# The ``eager`` fixture only sets a constant, the same for every example.
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(params=[True, False], ids=["eager", "traced"])
def eager(request, monkeypatch):
    """Both paths of ``pack`` / ``gather_flat``: ``eager()`` is False under torch.compile
    and fake tensor mode, where the functional form is taken."""
    monkeypatch.setattr(bucket.flat, "eager", lambda: request.param)
    return request.param


# --------------------------------------------------------------------------- member, _target
def test_member_gathers_only_data_axes_shard_to_replicate():
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    m = bucket.member((S1, R), (R, R), None, (4, 6), torch.bfloat16, data_dims=(0,))
    assert m is not None
    assert (m.storage, m.compute, m.grads, m.shape, m.dtype) == ((S1, R), (R, R), None, (4, 6), torch.bfloat16)
    assert m.gather == ((0, 1),) and m.stride == (6, 1)
    # equal placements move nothing, whatever the axis
    assert bucket.member((R, S0), (R, S0), [R, S0], (4, 6), torch.float32, (0,)).gather == ()
    assert bucket.member((R, S0), (R, S0), [R, S0], (4, 6), torch.float32, (0,)).grads == (R, S0)
    # a gather over a non-data axis, a Shard -> Shard move, a Replicate -> Shard move: not a bucket's
    assert bucket.member((R, S0), (R, R), None, (4, 6), torch.float32, data_dims=(0,)) is None
    assert bucket.member((S0, R), (S1, R), None, (4, 6), torch.float32, data_dims=(0,)) is None
    assert bucket.member((R, R), (S0, R), None, (4, 6), torch.float32, data_dims=(0,)) is None
    assert bucket.member((Partial(), R), (R, R), None, (4, 6), torch.float32, data_dims=(0,)) is None


def test_member_gathers_inner_mesh_dim_first():
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    m = bucket.member((S0, S1, S0), (R, R, R), None, (8, 4, 2), torch.float32, data_dims=(0, 1, 2))
    assert m.gather == ((2, 0), (1, 1), (0, 0)) and m.stride == (8, 2, 1)
    m = bucket.member((S1, R, S0), (R, R, R), None, (8, 4), torch.float32, data_dims=(0, 2))
    assert m.gather == ((2, 0), (0, 1))


def test_member_of_a_parameter_larger_than_memory():
    """Lowering reads a member's strides off its shape alone (fake meshes place models far
    larger than this machine's memory: tests/fake)."""
    R, S0 = Replicate(), Shard(0)
    m = bucket.member((S0,), (R,), None, (2**31, 2**20), torch.float32, data_dims=(0,))  # 8 PiB
    assert m.stride == (2**20, 1)


def test_target_is_grads_or_storage_keeping_partial():
    R, S0, P = Replicate(), Shard(0), Partial()
    m = bucket.member((S0, R), (R, R), (S0, R), (4, 4), torch.float32, (0, 1))
    assert bucket.spec.grad_target(m, [P, P]) == (S0, R)
    local = bucket.member((S0, R, S0), (R, R, R), None, (4, 4), torch.float32, (0, 1, 2))
    assert bucket.spec.grad_target(local, [P, R, P]) == (P, R, P)
    assert bucket.spec.grad_target(local, [R, P, S0]) == (S0, P, S0)


# --------------------------------------------------------------------------- _groups, _gather_steps
@SETTINGS
@given(
    st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from([None, 0, 1, "a"])), min_size=0, max_size=8), st.data()
)
def test_groups_partition_by_dtype_and_key(specs, data):
    xs = [torch.zeros(1, dtype=dt) for dt, _k in specs]
    key = {j: k for j, (_dt, k) in enumerate(specs) if k is not None}
    idx = data.draw(st.permutations(range(len(xs))).map(lambda p: p[: data.draw(st.integers(0, len(p)))]))
    force = data.draw(st.sampled_from([None, torch.float32]))
    groups = bucket.flat.group_indices(list(idx), xs, key, force)
    # a partition of idx, each group in idx's order, the groups in order of their first index
    assert sorted(j for g in groups for j in g) == sorted(idx)
    pos = {j: n for n, j in enumerate(idx)}
    assert all([pos[j] for j in g] == sorted(pos[j] for j in g) for g in groups)
    assert [pos[g[0]] for g in groups] == sorted(pos[g[0]] for g in groups)
    # one group per distinct (dtype, key): the forced dtype where given
    sig = {j: (force or xs[j].dtype, key.get(j)) for j in idx}
    assert all(len({sig[j] for j in g}) == 1 for g in groups)
    assert len(groups) == len(set(sig.values()))
    assert bucket.flat.by_dtype(list(idx), xs) == bucket.flat.group_indices(list(idx), xs, {})


def test_gather_steps_inner_dim_first_grouped_by_dtype():
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    f32, bf16 = torch.float32, torch.bfloat16
    mk = bucket.member
    members = (
        mk((S0, S1, R), (R, R, R), None, (4, 4), f32, (0, 1, 2)),  # over dims 0 and 1
        mk((R, S0, R), (R, R, R), None, (4, 4), bf16, (0, 1, 2)),  # over dim 1
        mk((R, R, R), (R, R, R), None, (4, 4), f32, (0, 1, 2)),  # none
        mk((S1, S0, S0), (R, R, R), None, (4, 4), f32, (0, 1, 2)),  # dims 0, 1 and 2 (size 1)
        mk((S0, R, R), (R, R, R), None, (4, 4), bf16, (0, 1, 2)),
    )  # over dim 0
    b = bucket.Bucket(
        mesh=None,
        groups=("g0", "g1", ""),
        sizes=(2, 3, 1),
        data_dims=(0, 1, 2),
        members=members,
        compute_dtype=None,
        reduce_dtype=None,
        local=True,
    )
    xs = [torch.zeros(1, dtype=m.dtype) for m in members]
    assert bucket.prefetch.gather_steps(b, xs) == [(1, [[0, 3], [1]]), (0, [[0, 3], [4]])]
    # the dtype of each flat buffer is that of the tensors gathered (the compute dtype, cast first)
    xs = [torch.zeros(1, dtype=bf16) for _ in members]
    assert bucket.prefetch.gather_steps(b, xs) == [(1, [[0, 1, 3]]), (0, [[0, 3, 4]])]
    b2 = bucket.Bucket(
        mesh=None,
        groups=("g0", "g1", ""),
        sizes=(1, 3, 1),
        data_dims=(0, 1, 2),
        members=members,
        compute_dtype=None,
        reduce_dtype=None,
        local=True,
    )
    assert bucket.prefetch.gather_steps(b2, xs) == [(1, [[0, 1, 3]])]


# --------------------------------------------------------------------------- _split
@SETTINGS
@given(st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=4), st.integers(0, 3))
def test_split_cuts_views_in_order(shapes, extra):
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.randn(total + extra)
    parts = bucket.flat.split_flat(flat, [tuple(s) for s in shapes])
    assert [tuple(p.shape) for p in parts] == [tuple(s) for s in shapes]
    assert all(shares_storage(p, flat) for p in parts)
    assert torch.equal(torch.cat([p.reshape(-1) for p in parts]), flat[:total])


# --------------------------------------------------------------------------- _pack
def _ref_pack(gs, dims, n, dtype):
    """Rank r's block (``chunk(n, d)[r]``) of every tensor, row r after row r-1, cast."""
    dtype = dtype or gs[0].dtype
    if dims is None:
        return torch.cat([g.to(dtype).flatten() for g in gs])
    return torch.cat([g.to(dtype).chunk(n, d)[r].flatten() for r in range(n) for g, d in zip(gs, dims)])


@st.composite
def _packs(draw):
    n = draw(st.integers(1, 4))
    scatter = draw(st.booleans())
    gs, dims = [], []
    src = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        d = draw(st.integers(0, len(shape) - 1))
        if scatter:
            shape[d] *= n
        dt = src if draw(st.integers(0, 3)) else draw(st.sampled_from(DTYPES))  # mostly one dtype
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dt)
        if len(shape) > 1 and draw(st.booleans()):  # a non-contiguous gradient
            g = g.transpose(0, 1).contiguous().transpose(0, 1)
        gs.append(g)
        dims.append(d)
    return gs, dims if scatter else None, n, draw(st.sampled_from([None, *DTYPES]))


@SETTINGS
@given(_packs())
def test_pack_lays_out_rank_blocks_cast(eager, case):
    gs, dims, n, dtype = case
    before = [g.clone() for g in gs]
    flat, own = bucket.flat.pack(gs, dims, n, dtype)
    want = _ref_pack(gs, dims, n, dtype)
    assert flat.dtype == want.dtype and flat.shape == want.shape and flat.dim() == 1
    assert torch.equal(flat, want)
    assert all(torch.equal(g, b) for g, b in zip(gs, before))  # the gradients are read only
    # eager: one buffer of its own, unless the single gradient already is the flat layout
    as_is = len(gs) == 1 and gs[0].dtype == want.dtype and gs[0].is_contiguous() and (dims is None or dims[0] == 0)
    assert own == (eager and not as_is)
    if eager and as_is:
        assert shares_storage(flat, gs[0])  # no copy
    if own:
        assert not any(shares_storage(flat, g) for g in gs)


def test_pack_cases_by_hand(eager):
    """The layout on a case small enough to read: two ranks, a row-split and a column-split tensor."""
    a = torch.arange(4.0).view(2, 2)  # rows [0, 1] | [2, 3]
    b = torch.arange(10.0, 14.0).view(2, 2)  # columns [10, 12] | [11, 13]
    flat, _ = bucket.flat.pack([a, b], [0, 1], 2, torch.float64)
    assert flat.tolist() == [0, 1, 10, 12, 2, 3, 11, 13] and flat.dtype == torch.float64
    assert bucket.flat.pack([a, b], None, 2, None)[0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert bucket.flat.pack([b], [1], 2, None)[0].tolist() == [10, 12, 11, 13]
