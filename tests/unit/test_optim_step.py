"""``ShardedOptimizer._step_local`` (NOTE [local step]) in one process: the torch optimizer
run on the masters' local tensors must update them, and keep its state, exactly as the same
optimizer on plain tensors does, with ``inner.state`` keyed by the DTensor masters and
holding DTensors placed like them (sharing the local state's storage)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness.simworld import fake_mesh
from meshlm.runtime.optim import sharded as optim


@pytest.fixture
def mesh():
    yield fake_mesh((2, 2))
    if dist.is_initialized():
        dist.destroy_process_group()


def _sharded(mesh, local, placements, full_shape):
    stride = torch.empty(full_shape).stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full_shape, stride=stride)


def _opt(inner):
    o = object.__new__(optim.ShardedOptimizer)  # only what _step_local reads
    o.inner, o._locals, o._wrapped = inner, {}, {}
    return o


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 0.01}),
    ],
)
def test_step_local_is_the_optimizer_on_the_local_tensors(mesh, cls, kw):
    gen = torch.Generator().manual_seed(0)
    specs = [
        ((Shard(0), Replicate()), (3, 4), (6, 4)),
        ((Replicate(), Shard(1)), (5, 2), (5, 4)),
        ((Replicate(), Replicate()), (7,), (7,)),
    ]
    locals_ = [torch.randn(loc, generator=gen) for _pl, loc, _full in specs]
    masters = [nn.Parameter(_sharded(mesh, x.clone(), pl, full)) for x, (pl, _l, full) in zip(locals_, specs)]
    ref = [nn.Parameter(x.clone()) for x in locals_]
    # two param groups, the second with its own lr
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]  # noqa: E731
    opt, ref_opt = _opt(cls(groups(masters), **kw)), cls(groups(ref), **kw)
    for step in range(3):
        for j, (m, r) in enumerate(zip(masters, ref)):
            if step == 1 and j == 1:  # a parameter without a gradient this step: skipped
                m.grad, r.grad = None, None
                continue
            g = torch.randn(r.shape, generator=gen)
            r.grad = g.clone()
            m.grad = _sharded(mesh, g.clone(), m.placements, m.shape)
        opt._step_local()
        ref_opt.step()
        for j, (m, r) in enumerate(zip(masters, ref)):
            assert torch.equal(m._local_tensor, r.detach()), (step, j)
        # the optimizer is left on the masters, its state keyed by them, as DTensors placed like them
        assert [g["params"] for g in opt.inner.param_groups] == [masters[:2], masters[2:]]
        assert {id(k) for k in opt.inner.state} == {id(m) for m in masters if m in opt.inner.state}  # no locals
        for m, r in zip(masters, ref):
            st, want = opt.inner.state.get(m, {}), ref_opt.state.get(r, {})
            assert set(st) == set(want), step
            for k, v in st.items():
                if isinstance(want[k], torch.Tensor) and want[k].shape == r.shape:
                    assert isinstance(v, DTensor) and tuple(v.placements) == tuple(m.placements) and v.shape == m.shape
                    assert torch.equal(v._local_tensor, want[k]), (step, k)
                else:
                    assert not isinstance(v, DTensor) and torch.equal(torch.as_tensor(v), torch.as_tensor(want[k]))
    assert {id(k) for k in opt.inner.state} == {id(m) for m in masters}


def test_state_dtensors_are_built_once_and_share_the_local_state(mesh):
    m = nn.Parameter(_sharded(mesh, torch.zeros(3, 4), (Shard(0), Replicate()), (6, 4)))
    opt = _opt(torch.optim.AdamW([m], lr=0.1))
    seen = []
    for _ in range(2):
        m.grad = _sharded(mesh, torch.ones(3, 4), m.placements, m.shape)
        opt._step_local()
        seen.append(opt.inner.state[m]["exp_avg"])
        local = opt._locals[id(m)]
        assert local.data.data_ptr() == m._local_tensor.data_ptr() and local.grad is None
    assert seen[0] is seen[1]  # the same DTensor: its local tensor is the state the optimizer updates
    assert (
        seen[1]._local_tensor.untyped_storage().data_ptr()
        == opt.inner.state[m]["exp_avg"]._local_tensor.untyped_storage().data_ptr()
    )
    # a master whose storage was replaced gets a fresh local parameter
    with torch.no_grad():
        m._local_tensor = torch.zeros(3, 4)
    m.grad = _sharded(mesh, torch.ones(3, 4), m.placements, m.shape)
    opt._step_local()
    assert opt._locals[id(m)].data.data_ptr() == m._local_tensor.data_ptr()
    assert not torch.equal(m._local_tensor, torch.zeros(3, 4))


def test_a_loaded_state_is_the_one_stepped_and_kept(mesh):
    """``load_state_dict`` after some steps (a rollback within the process): the next steps
    start from the loaded state, and the state DTensors kept afterwards are the loaded
    state's updated values (their wrappers built anew around the loaded tensors, not the
    ones built around the state that was replaced)."""
    import copy

    gen = torch.Generator().manual_seed(3)
    m = nn.Parameter(_sharded(mesh, torch.randn(3, 4, generator=gen), (Shard(0), Replicate()), (6, 4)))
    r = nn.Parameter(m._local_tensor.detach().clone())
    opt, ref_opt = _opt(torch.optim.AdamW([m], lr=0.1)), torch.optim.AdamW([r], lr=0.1)
    saved = None
    for step in range(5):
        g = torch.randn(3, 4, generator=gen)
        m.grad, r.grad = _sharded(mesh, g.clone(), m.placements, m.shape), g.clone()
        opt._step_local()
        ref_opt.step()
        if step == 0:
            saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
        if step == 2:  # roll both back to the state after step 0 (the weights go on)
            opt.load_state_dict(saved[0])
            ref_opt.load_state_dict(saved[1])
        assert torch.equal(m._local_tensor, r.detach()), step
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.inner.state[m][k]._local_tensor, ref_opt.state[r][k]), (step, k)


def test_a_fused_optimizer_steps_a_view_master_without_writing_outside_it(mesh):
    """NOTE [fused and views]: torch's fused AdamW on the CPU writes outside a tensor that is
    not contiguous; a master that is a column block of its parameter (ZeRO-1/2 sharding an
    inner dim) is stepped through a contiguous copy: the view holds what the fused step of a
    plain tensor gives, and the rest of the parameter is untouched, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(8, 6, generator=gen)  # the parameter's storage; the master: columns 3-5
    view = whole[:, 3:]
    assert not view.is_contiguous()
    master = nn.Parameter(_sharded(mesh, view, (Replicate(), Shard(1)), (8, 12)))
    ref = nn.Parameter(view.clone())
    kw = {"lr": 0.1, "weight_decay": 0.1, "fused": True}
    opt, ref_opt = _opt(torch.optim.AdamW([master], **kw)), torch.optim.AdamW([ref], **kw)
    outside = whole[:, :3].clone()
    for _step in range(3):
        g = torch.randn(8, 3, generator=gen) * torch.rand(8, 3, generator=gen)
        ref.grad = g.clone()
        master.grad = _sharded(mesh, g.clone(), master.placements, master.shape)
        opt._step_local()
        ref_opt.step()
        assert torch.equal(whole[:, 3:], ref.detach()) and torch.equal(whole[:, :3], outside)
        assert torch.equal(opt.inner.state[master]["exp_avg"]._local_tensor, ref_opt.state[ref]["exp_avg"])
