"""meshlm's DTensor rules and implicit replication act on meshlm's meshes only (NOTE [scoped
patches] in meshlm/_torch_compat/dtensor_scope.py): in one process, on a one-rank gloo group,
a mesh meshlm made next to one it did not, after meshlm installed its rules and held implicit
replication on as a sharded forward does.  The other mesh gets what torch's DTensor gives;
tests/dist/test_stock_dtensor.py compares with workers that never imported meshlm."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshlm
from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_ops

MIXED = "got mixed torch.Tensor and DTensor"


@pytest.fixture
def meshes():
    """(a mesh meshlm made, an equal-sized one it did not), rules installed, replication held."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dtensor_ops.install()
    dtensor_ops.allow_implicit_replication()
    yield meshlm.make_mesh("tp=1"), init_device_mesh("cpu", (1,))
    compat.clear_dtensor_caches()
    dist.destroy_process_group()


def test_rules_act_on_meshlm_meshes_only(meshes):
    mine, other = meshes
    table, ids = torch.randn(8, 3), torch.tensor([[1, 5, 7]])
    for mesh, is_mine in ((mine, True), (other, False)):
        emb = F.embedding(distribute_tensor(ids, mesh, [Replicate()]), distribute_tensor(table, mesh, [Shard(0)]))
        # meshlm's vocab-parallel rule: a plain partial sum; DTensor's: its masked subclass of Partial
        assert (type(emb.placements[0]) is Partial) == is_mine, emb.placements
        torch.testing.assert_close(emb.full_tensor(), F.embedding(ids, table), rtol=0, atol=0)
        if is_mine:  # meshlm's CPU flash attention rules, forward and backward
            q = distribute_tensor(torch.randn(1, 2, 4, 8), mesh, [Shard(1)]).requires_grad_()
            F.scaled_dot_product_attention(q, q, q).sum().backward()
            assert tuple(q.grad.placements) == (Shard(1),)
        # On the other mesh DTensor has no rule for the backward: tests/dist/test_stock_dtensor.py
        # ("cpu flash attention backward", as in workers without meshlm).  Here it would cost
        # ~10 s: torch 2.13 propagates the forward's sharding through its decomposition.


def test_implicit_replication_on_meshlm_meshes_only(meshes):
    """A plain tensor next to a DTensor: replicated on meshlm's mesh; on the other mesh
    refused, allowed inside torch's implicit_replication() and refused again after it (DTensor
    caches the op it let through), and the flag reads as torch code set it."""
    from torch.distributed.tensor.experimental import implicit_replication

    mine, other = meshes
    a = distribute_tensor(torch.arange(6.0).view(2, 3), mine, [Replicate()])
    b = distribute_tensor(torch.arange(6.0).view(2, 3), other, [Replicate()])
    assert torch._C._get_dtensor_allow_implicit_replication()  # held on, as after a sharded forward
    assert DTensor._op_dispatcher._allow_implicit_replication is False
    torch.testing.assert_close((a + torch.ones(2, 3)).full_tensor(), torch.arange(6.0).view(2, 3) + 1)
    with pytest.raises(RuntimeError, match=MIXED):
        b + torch.ones(2, 3)
    with implicit_replication():
        assert DTensor._op_dispatcher._allow_implicit_replication is True
        torch.testing.assert_close((b * torch.ones(2, 3)).full_tensor(), torch.arange(6.0).view(2, 3))
    assert DTensor._op_dispatcher._allow_implicit_replication is False
    with pytest.raises(RuntimeError, match=MIXED):
        b * torch.ones(2, 3)
    torch.testing.assert_close((a * torch.ones(2, 3)).full_tensor(), torch.arange(6.0).view(2, 3))


def test_loss_parallel_puts_its_handlers_under_meshlm_rules(meshes):
    """Inside torch's loss_parallel() the other mesh runs torch's loss handlers; after the
    block meshlm's loss rule still holds on its mesh (before: the block deleted it) and the
    other mesh is back to DTensor's refusal of plain labels."""
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import customized_loss_ops as loss_ops

    mine, other = meshes
    full, labels = torch.randn(6, 8), torch.randint(0, 8, (6,))
    want = F.cross_entropy(full, labels)
    with loss_parallel():
        for mesh in (mine, other):
            got = F.cross_entropy(distribute_tensor(full, mesh, [Shard(1)]), labels)
            torch.testing.assert_close(got.full_tensor(), want)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    assert all(handlers.get(op) is dtensor_ops._dispatch for op in loss_ops), "loss_parallel() removed meshlm's"
    torch.testing.assert_close(F.cross_entropy(distribute_tensor(full, mine, [Shard(1)]), labels).full_tensor(), want)
    with pytest.raises(RuntimeError, match=MIXED):
        F.cross_entropy(distribute_tensor(full, other, [Shard(1)]), labels)


def test_one_ids_tensor_for_two_vocab_sharded_tables(meshes):
    """The backward of a vocab-parallel lookup finds what its forward left on the ids, per
    table: two tables of different sizes looked up with the same ids DTensor each get their
    own gradient (before: one process-wide dict keyed by the ids' id() held the second
    table's rows for both, and the first table's backward built a gradient of the wrong size)."""
    mine, _ = meshes
    ids = torch.tensor([[1, 5, 3]])
    small, big = torch.randn(6, 3), torch.randn(10, 3)
    did = distribute_tensor(ids, mine, [Replicate()])
    ws = [distribute_tensor(w, mine, [Shard(0)]).requires_grad_() for w in (small, big)]
    loss = sum((F.embedding(did, w) * (k + 1)).sum() for k, w in enumerate(ws))
    loss.backward()
    for k, (w, ref) in enumerate(zip(ws, (small, big))):
        want = torch.zeros_like(ref).index_add_(0, ids.flatten(), torch.full((3, 3), float(k + 1)))
        torch.testing.assert_close(w.grad.full_tensor(), want, rtol=0, atol=0)


def test_a_mesh_stays_meshlms_when_an_equal_one_is_collected(meshes):
    """Two equal meshes meshlm made (as the planner makes one per candidate): when the first
    is collected, the second, alive, is still meshlm's and its ops get meshlm's rules."""
    import gc

    from meshlm._torch_compat import dtensor_scope

    first = meshlm.make_mesh("tp=1")
    second = meshlm.make_mesh("tp=1")
    assert first == second and first is not second
    del first
    gc.collect()
    assert dtensor_scope.owns(second)
    q = distribute_tensor(torch.randn(1, 2, 4, 8), second, [Shard(1)]).requires_grad_()
    F.scaled_dot_product_attention(q, q, q).sum().backward()  # meshlm's backward rule; torch has none
    assert tuple(q.grad.placements) == (Shard(1),)
