"""optim.py's helpers that decide numbers, in one process: the chunks of the optimizer's
flat collectives (``outside_chunks``, ``_chunk_keys``), the master that is a view of this
rank's block (``optim_chunks.shard_view``, on a fake process group, one rank at a time) and the global
gradient norm (``grad_norm``, on simulated ranks: harness.simworld)."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.simworld import SimWorld, fake_mesh, locals_of
from meshlm import block
from meshlm.runtime.optim import chunks as optim_chunks
from meshlm.runtime.optim import sharded as optim

SETTINGS = settings(max_examples=200, deadline=None, database=None, derandomize=True)


# --------------------------------------------------------------------------- outside_chunks
@SETTINGS
@given(st.lists(st.integers(1, 50), max_size=12), st.integers(0, 80))
def test_outside_chunks_greedy_within_cap(nbytes, cap):
    out = optim_chunks.outside_chunks(nbytes, cap)
    assert len(out) == len(nbytes)
    assert out[:1] in ([], [0]) and all(b - a in (0, 1) for a, b in zip(out, out[1:]))  # consecutive from 0
    chunks = [[n for n, g in zip(nbytes, out) if g == k] for k in range(out[-1] + 1 if out else 0)]
    assert all(sum(c) <= cap or len(c) == 1 for c in chunks)  # within cap, or one larger parameter
    assert all(sum(a) + b[0] > cap for a, b in zip(chunks, chunks[1:]))  # a chunk closes only when full


def test_outside_chunks_by_hand():
    assert optim_chunks.outside_chunks([4, 4, 4, 10, 1, 1], 8) == [0, 0, 1, 2, 3, 3]
    assert optim_chunks.outside_chunks([8, 1], 8) == [0, 1]
    assert optim_chunks.outside_chunks([9, 9], 8) == [0, 1]
    assert optim_chunks.outside_chunks([3, 5], 8) == [0, 0]


# --------------------------------------------------------------------------- _chunk_keys
@block
class _Blk(nn.Module):
    def __init__(self, n: int, inner: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.sub = _Blk(n // 2) if inner else None  # a block inside a block: the outer one's chunk


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.zeros(30))  # 120 B
        self.pos = nn.Parameter(torch.zeros(20, dtype=torch.bfloat16))  # 40 B
        self.blocks = nn.ModuleList([_Blk(20, inner=True), _Blk(16), _Blk(8)])  # 120, 64, 32 B
        self.norm = nn.Parameter(torch.zeros(10))  # 40 B
        self.head = nn.Parameter(torch.zeros(25))  # 100 B


def _params(net):
    b = net.blocks
    return [net.emb, net.pos, b[0].w, b[0].sub.w, b[1].w, b[2].w, net.norm, net.head]


def test_chunk_keys_blocks_then_outside_within_the_largest_block():
    net = _Net()
    params = _params(net)
    keys = optim_chunks.chunk_keys(net, params)
    # outside the blocks, within the largest block's 120 B: [emb] [pos, norm] [head]
    out = ("outside", 0), ("outside", 1), ("outside", 1), ("outside", 2)
    assert keys == [out[0], out[1], 0, 0, 1, 2, out[2], out[3]]
    assert optim_chunks.chunk_keys(_Blk(8), [_Blk(8).w]) == [("outside", 0)]  # no block of the model holds it


def test_chunk_keys_merged_to_bucket_bytes():
    net = _Net()
    params = _params(net)
    # chunks in order of first appearance: emb 120, pos+norm 80, block 0 120, 1 64, 2 32, head 100
    # a merged chunk closes once it holds at least the bucket's bytes:
    # 150 B: [emb pos+norm: 200] [blocks 0, 1: 184] [block 2, head: 132]
    assert optim_chunks.chunk_keys(net, params, 150) == [("bucket", k) for k in (0, 0, 1, 1, 1, 2, 0, 2)]
    # 200 B: [emb pos+norm: 200] [blocks 0, 1, 2: 216] [head]
    assert optim_chunks.chunk_keys(net, params, 200) == [("bucket", k) for k in (0, 0, 1, 1, 1, 1, 0, 2)]
    # 120 B: [emb] [pos+norm, block 0: 200] [blocks 1, 2, head: 196]
    assert optim_chunks.chunk_keys(net, params, 120) == [("bucket", k) for k in (0, 1, 1, 1, 2, 2, 1, 2)]
    assert optim_chunks.chunk_keys(net, params, 1) == [("bucket", k) for k in (0, 1, 2, 2, 3, 4, 1, 5)]
    assert optim_chunks.chunk_keys(net, params, 10**6) == [("bucket", 0)] * 8


def test_chunk_keys_of_a_model_without_blocks_one_chunk_per_parameter():
    """No blocks (a user's model that annotates none): nothing bounds a shared chunk, so
    each parameter is a chunk of its own, and there is no largest block to measure."""
    net = nn.Module()
    net.a, net.b, net.c = (nn.Parameter(torch.zeros(n)) for n in (4, 1, 9))
    assert optim_chunks.chunk_keys(net, [net.a, net.b, net.c]) == [("outside", 0), ("outside", 1), ("outside", 2)]


# --------------------------------------------------------------------------- shard_view
@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [(2,), (2, 2), (3, 2)])
def test_shard_view_is_this_ranks_block_as_a_view(fake_world, sizes):
    full = torch.arange(144.0).view(12, 12)  # every value names its position
    choices = [Replicate(), Shard(0), Shard(1)]
    gen = torch.Generator().manual_seed(0)
    seen = {"view": 0, "none": 0}
    for r in range(math.prod(sizes)):
        mesh = fake_mesh(sizes, r)
        c = tuple(mesh.get_coordinate())
        for sp, op in itertools.product(itertools.product(choices, repeat=len(sizes)), repeat=2):
            local = locals_of(full, sp, sizes, gen)[c].clone()
            p = DTensor.from_local(local, mesh, sp, run_check=False, shape=full.shape, stride=full.stride())
            got = optim_chunks.shard_view(p, op)
            want = locals_of(full, op, sizes, gen)[c]
            splits_only = all(a == b or (a == Replicate() and isinstance(b, Shard)) for a, b in zip(sp, op))
            inside = set(want.flatten().tolist()) <= set(local.flatten().tolist())
            if not (splits_only and inside):
                assert got is None, (r, sp, op)
                seen["none"] += 1
                continue
            assert got is not None, (r, sp, op)
            assert tuple(got.placements) == op and got.shape == full.shape and got.stride() == full.stride()
            assert torch.equal(got._local_tensor, want), (r, sp, op)
            assert got._local_tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            seen["view"] += 1
    assert seen["view"] and seen["none"]


def test_shard_view_of_uneven_shards_is_none(fake_world):
    mesh = fake_mesh((2,), 1)
    p = DTensor.from_local(torch.zeros(3, 4), mesh, (Replicate(),), run_check=False, shape=(3, 4), stride=(4, 1))
    assert optim_chunks.shard_view(p, (Shard(0),)) is None
    assert optim_chunks.shard_view(p, (Shard(1),)) is not None


# --------------------------------------------------------------------------- grad_norm
@pytest.mark.parametrize("sizes", [(2,), (2, 2)])
def test_grad_norm_counts_every_element_once(fake_world, monkeypatch, sizes):
    """Each rank's sum of squares over its shards, a replicated shard counted once, summed
    over the mesh (simulated ranks): the norm of the global gradients, on every rank."""
    mesh = fake_mesh(sizes, 0)  # a mesh object for the DTensors; the sums are the simulation's
    world = SimWorld(sizes, [mesh.get_group(i) for i in range(len(sizes))])
    world.patch(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    fulls = [torch.randint(-3, 4, (4, 6), generator=gen).float() for _ in range(3)]
    plain = torch.randint(-3, 4, (5,), generator=gen).float()  # a plain tensor: the same on every rank
    pls = [(Shard(0),) * len(sizes), (Replicate(),) * len(sizes), (Shard(1), Replicate())[: len(sizes)]]
    locs = [locals_of(f, pl, sizes, gen) for f, pl in zip(fulls, pls)]

    def rank(_r, c):
        gs = [
            DTensor.from_local(lc[c], mesh, pl, run_check=False, shape=f.shape, stride=f.stride())
            for lc, pl, f in zip(locs, pls, fulls)
        ]
        return optim.grad_norm(gs + [plain], mesh)

    want = torch.linalg.vector_norm(torch.cat([f.flatten() for f in fulls] + [plain]), dtype=torch.float64)
    for got in world.run(rank):
        assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)


def test_grad_norm_of_gradients_whose_squares_overflow_float32_is_finite(fake_world):
    """Squares summed in float64: gradients of 1e20 (squares past float32's 3.4e38) have a
    finite norm, so only a non-finite gradient makes it Inf (what LossScaler and clipping
    rely on), and a Partial gradient is refused, naming the fix."""
    mesh = fake_mesh((1,), 0)
    g = torch.tensor([3e20, 4e20])
    d = DTensor.from_local(g, mesh, (Replicate(),), run_check=False, shape=g.shape, stride=g.stride())
    got = optim.grad_norm([d], mesh)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(5e20, rel=1e-6)
    partial = DTensor.from_local(g, mesh, (Partial(),), run_check=False, shape=g.shape, stride=g.stride())
    with pytest.raises(RuntimeError, match=r"^grad_norm needs reduced gradients; call reduce_grads\(\) first$"):
        optim.grad_norm([partial], mesh)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_grad_norm_of_few_or_no_gradients_joins_the_reduction_in_float64(fake_world, monkeypatch, n):
    """A rank may hold no gradient at all (a pipeline stage of frozen parameters): its norm
    is 0 and it still joins each mesh dim's all-reduce, with the same float64 scalar as the
    ranks that have some (gloo and NCCL need one dtype and shape on every rank)."""
    from meshlm import _torch_compat as compat

    mesh = fake_mesh((2,), 0)
    seen = []

    def all_reduce(t, op, group):
        seen.append((t.dtype, tuple(t.shape)))
        return t

    monkeypatch.setattr(compat, "all_reduce", all_reduce)
    gs = [torch.full((2,), 3.0 * (i + 1)) for i in range(n)]
    ds = [DTensor.from_local(g, mesh, (Replicate(),), run_check=False, shape=g.shape, stride=g.stride()) for g in gs]
    got = optim.grad_norm(ds, mesh)
    assert seen == [(torch.float64, ())]
    want = torch.linalg.vector_norm(torch.cat(gs)) if gs else torch.tensor(0.0)
    # the recorded all-reduce adds nothing: this rank's share, half the replicated squares
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item() / 2**0.5, rel=1e-6)
