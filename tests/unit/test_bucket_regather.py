"""``bucket.regather``, eager ZeRO-3's free and re-gather (NOTE [free and re-gather]), on a
fake fsdp mesh whose collectives stand for replicas (``patch_replicas``: every rank holds
this rank's shard, so a gathered parameter is its shard repeated).

A block is run the way ``lowering.blocks._run_freeing`` runs one: its parameters gathered
(``bucket.gather``), a ``Freed`` made of them, the block's math, ``free_after`` on its
outputs.  Checked: after forward every gathered storage is freed but the stored shards
(a parameter that did not move is gathered as a view of its shard); backward re-gathers
them first, so its gradients equal, bit for bit, the same block run without freeing; once
the block's backward is done they are freed again; the gathering counter the re-gathering
checkpoint policy reads; the block's outputs keep their structure; and a re-gather under
overlap issues the previous block's gather early (NOTE [prefetch]), and not otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness.simworld import data_bucket, fake_mesh, patch_replicas, shares_storage
from meshlm import _torch_compat as compat
from meshlm.core.state import RUN, counting, scope
from meshlm.runtime import bucket
from meshlm.runtime.bucket.prefetch import Prefetch

R, S0, S1 = Replicate(), Shard(0), Shard(1)
f32 = torch.float32

# (storage, compute, grads, shape) per member: a bias that does not move (DDP-like: its
# gathered tensor is a view of the stored shard and must never be freed), then two sharded
# weights, gathered in one flat all-gather: ROWS both along dim 0, COLS one along dim 1
# (gather_flat then copies every member out of the buffer).  Either way each gathered weight
# has a storage of its own.
ROWS = [((R,), (R,), (R,), (3,)), ((S0,), (R,), (S0,), (4, 3)), ((S0,), (R,), (S0,), (6, 3))]
COLS = [((R,), (R,), (R,), (3,)), ((S0,), (R,), (S0,), (4, 3)), ((S1,), (R,), (S1,), (3, 6))]


@pytest.fixture
def calls(monkeypatch):
    """A 2-rank replica mesh; the all-gathers issued, as (gathering counter, in backward)."""
    mesh = fake_mesh((2,))
    patch_replicas(monkeypatch)
    log: list[tuple[int, bool]] = []
    gather = compat.all_gather_single

    def logged(t, dim, group):
        log.append((RUN.gathering, compat.in_backward()))
        return gather(t, dim, group)

    monkeypatch.setattr(compat, "all_gather_single", logged)
    yield mesh, log
    RUN.gathering = 0
    if dist.is_initialized():
        dist.destroy_process_group()


def _block(mesh, specs, overlap=False, seed=0):
    """A bucket of ``specs`` on ``mesh`` and its stored parameters (random shards)."""
    key, b, shards = data_bucket(mesh, specs, overlap=overlap, seed=seed)
    params = [
        torch.nn.Parameter(
            DTensor.from_local(t, mesh, m.storage, run_check=False, shape=torch.Size(m.shape), stride=m.stride)
        )
        for t, m in zip(shards, b.members)
    ]
    return key, params


def _math(ys, x, rows: bool):
    bias, w, u = ys
    h = torch.tanh(x @ w + bias)
    return h @ (u.T if rows else u)


def _forward(key, params, x, rows, *, free, wrap="tuple", site=None):
    """One block's forward as the lowering runs it; its outputs, its gathered tensors and
    their Freed (None without freeing)."""
    with scope(site=site):
        ys = bucket.gather(key, True, *params)
    freed = None
    if free:
        freed = bucket.Freed(key, params, ys, True, site)
        bucket.free_after_backward(freed, ys)
    out = _math(ys, x, rows)
    res = {"tuple": lambda: (out, "tag", None), "list": lambda: [out, 2.0], "tensor": lambda: out}[wrap]()
    if free:
        res = bucket.free_after(freed, res)
    return res, ys, freed


def _grads(params, x):
    return [compat.local_tensor(p.grad).clone() for p in params] + [x.grad.clone()]


def _run(key, params, rows, free, wrap):
    for p in params:
        p.grad = None
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    res, ys, freed = _forward(key, params, x, rows, free=free, wrap=wrap)
    out = res if wrap == "tensor" else res[0]
    return res, out, ys, freed, x


@pytest.mark.parametrize("wrap", ["tuple", "list", "tensor"])
@pytest.mark.parametrize("specs", [ROWS, COLS], ids=["rows", "cols"])
def test_freed_after_forward_regathered_for_backward_freed_again(calls, specs, wrap):
    mesh, log = calls
    rows = specs is ROWS
    key, params = _block(mesh, specs)
    _, ref_out, _, _, x_ref = _run(key, params, rows, False, wrap)
    ref_out.square().sum().backward()
    ref = _grads(params, x_ref)
    log.clear()

    res, out, ys, freed, x = _run(key, params, rows, True, wrap)
    # The outputs keep their structure: the same kind of container, the non-tensors as they were.
    if wrap == "tuple":
        assert type(res) is tuple and res[1:] == ("tag", None)
    elif wrap == "list":
        assert type(res) is list and res[1:] == [2.0]
    assert torch.equal(out, ref_out)
    kept = [shares_storage(y, compat.local_tensor(p)) for y, p in zip(ys, params)]
    assert kept == [True, False, False]  # the bias is its stored shard (a view), the rest gathered
    storages = {compat.storage_key(y.untyped_storage()) for y, k in zip(ys, kept) if not k}
    assert len(storages) == 2
    assert len(freed.slots) == len(storages)

    def sizes():
        return [y.untyped_storage().nbytes() for y in ys]

    assert sizes() == [12, 0, 0]  # freed when forward returns; the bias's shard (3 floats) kept
    assert torch.equal(compat.local_tensor(params[0]), ys[0])
    assert log == [(1, False)]  # the forward's gather

    seen = []
    out.register_hook(lambda g: seen.append(sizes()))  # runs before any of the block's backward
    out.square().sum().backward()
    assert seen == [[12, 0, 0]]
    # Backward re-gathered first (one all-gather, counted as gathering) and its gradients are
    # the run's without freeing, bit for bit; then the block's storages were freed again.
    assert log == [(1, False), (1, True)]
    got = _grads(params, x)
    assert all(torch.equal(g, r) for g, r in zip(got, ref)), [(g - r).abs().max() for g, r in zip(got, ref)]
    assert sizes() == [12, 0, 0]
    assert RUN.gathering == 0


def test_a_regather_restores_the_values_only_once_freed(calls):
    mesh, log = calls
    key, params = _block(mesh, COLS)
    with torch.no_grad():
        ys = bucket.gather(key, True, *params)
    before = [y.clone() for y in ys]
    versions = [y._version for y in ys]
    freed = bucket.Freed(key, params, ys, True)
    log.clear()
    freed.regather()  # not freed: nothing to do
    assert log == [] and [y.untyped_storage().nbytes() for y in ys] == [12, 48, 72]
    freed.free()
    assert [y.untyped_storage().nbytes() for y in ys] == [12, 0, 0]
    assert torch.equal(ys[0], before[0]) and torch.equal(compat.local_tensor(params[0]), before[0])
    # A counter, not a flag: inside another gather it counts one more and gives it back.
    with counting("gathering"):
        freed.regather()
        assert log == [(2, False)] and RUN.gathering == 1
    assert all(torch.equal(y, b) for y, b in zip(ys, before))
    # Written in place without a version bump: autograd's saved views stay valid.
    assert [y._version for y in ys] == versions
    freed.regather()  # already re-gathered
    assert log == [(2, False)]


def test_without_gradients_nothing_is_routed_or_hooked(calls):
    """An evaluation forward (no_grad): no gather node to hook, no output to route; the
    outputs come back as they were."""
    mesh, _log = calls
    key, params = _block(mesh, ROWS)
    x = torch.randn(2, 4)
    with torch.no_grad():
        ys = bucket.gather(key, True, *params)
        freed = bucket.Freed(key, params, ys, True)
        bucket.free_after_backward(freed, ys)
        res = (_math(ys, x, True), "tag")
        assert bucket.free_after(freed, res) is res


def test_a_regather_under_overlap_issues_the_previous_blocks_gather(calls):
    """Backward runs the blocks in reverse: block 1's re-gather issues block 0's first
    gather (NOTE [prefetch]), which block 0's re-gather then uses; without overlap nothing
    is issued early.  Either way the gradients are the same."""
    mesh, log = calls
    grads = {}
    for overlap in (False, True):
        keys, blocks = zip(*[_block(mesh, ROWS, overlap=overlap, seed=s) for s in (0, 1)])
        pf = Prefetch()
        pf.link(keys, [lambda ps=ps: list(ps) for ps in blocks])
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = x
        for pos in (0, 1):
            h, _ys, _freed = _forward(
                keys[pos], blocks[pos], h[..., :4], True, free=True, wrap="tensor", site=(pf, pos)
            )
        log.clear()
        h.square().sum().backward()
        grads[overlap] = [compat.local_tensor(p.grad) for ps in blocks for p in ps] + [x.grad]
        if overlap:
            # forward: block 0 issued block 1's gather, which block 1 used; backward: block
            # 1's re-gather issued block 0's, which block 0's re-gather used.
            assert pf.stats == {"issued": 2, "used": 2, "stale": 0} and not pf.inflight
        else:
            assert pf.stats == {"issued": 0, "used": 0, "stale": 0}
        assert log == [(1, True), (1, True)]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_a_block_of_one_parameter(calls):
    """One gathered tensor (its gather node's only output): freed, re-gathered, freed again."""
    mesh, log = calls
    key, (w,) = _block(mesh, [((S0,), (R,), (S0,), (4, 3))])
    x = torch.randn(2, 4, requires_grad=True)
    (y,) = bucket.gather(key, True, w)
    (x @ y).sum().backward()
    ref = compat.local_tensor(w.grad).clone()
    w.grad = None
    log.clear()
    (y,) = bucket.gather(key, True, w)
    freed = bucket.Freed(key, [w], [y], True)
    bucket.free_after_backward(freed, [y])
    out = bucket.free_after(freed, x @ y)
    assert y.untyped_storage().nbytes() == 0
    out.sum().backward()
    assert torch.equal(compat.local_tensor(w.grad), ref) and y.untyped_storage().nbytes() == 0
    assert log == [(1, False), (1, True)]
