"""``ShardedOptimizer.reduce_grads`` and ``step`` on simulated ranks (harness.simworld)
over a fake process group's mesh: every master's gradient must be its block, in the master's
placements and dtype, of the sum over ranks of the parameter's gradient (its main gradient
where it has one), and after the step every parameter its block of the updated master, with
one flat collective per mesh dim, chunk and dtype (NOTE [optimizer chunks]).  SGD with
``lr=1`` on small integers: every update is exact, results compared bit for bit."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.simworld import SimWorld, fake_mesh, locals_of
from meshlm._torch_compat import torch_at_least
from meshlm.runtime import main_grad
from meshlm.runtime.optim import sharded as optim

# These run DTensor ops on the threads of a SimWorld; torch 2.11's DTensor shape propagation
# (its FakeTensorMode) crashes off the main thread.  The library runs one rank per process.
pytestmark = pytest.mark.skipif(
    not torch_at_least(2, 13),
    reason="torch < 2.13: DTensor ops on SimWorld's threads crash in its fake-tensor shape propagation",
)

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
f32, bf16 = torch.float32, torch.bfloat16
SIZES = (2, 2)

# (parameter placements and dtype, its gradient's placements (("main", placements): an fp32
# main gradient) or None, the master's placements and dtype or None (the parameter is its
# own master), chunk)
CASES = [
    ((R, R), bf16, (P, P), ((S0, S0), f32), 0),  # ZeRO-1 with fp32 masters: reduce-scatter over both
    ((R, R), f32, (P, P), ((R, S1), f32), 0),  # ZeRO-1 over the inner dim only (HSDP-like)
    ((R, R), f32, (P, P), ((S0, S0), f32), 1),  # another chunk: its own collectives
    ((S0, R), bf16, (S0, R), ((S0, R), f32), 0),  # FSDP with fp32 masters: a cast, no collective
    ((R, R), bf16, ("main", (S1, R)), ((S1, R), f32), 1),  # a main gradient, already reduced (ZeRO-2)
    ((R, R), f32, (P, R), ((S0, R), f32), 0),  # ZeRO-1 over one dim, replicated over the other
    ((S0, S1), f32, (S0, S1), None, 0),  # its own master (direct)
    ((R, R), f32, None, ((S0, R), f32), 0),  # no gradient this step
    ((R, R), bf16, ("main", (P, P)), ((R, S0), f32), 1),  # a ZeRO-1 main gradient: reduced, then released
]
SHAPE = (4, 4)


@pytest.fixture
def mesh():
    yield fake_mesh(SIZES)
    if dist.is_initialized():
        dist.destroy_process_group()


def _dt(mesh, local, pl):
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=SHAPE, stride=(4, 1))


def _ints(gen):
    return torch.randint(-8, 9, SHAPE, generator=gen).float()


@pytest.mark.parametrize("local_step", [True, False])
def test_reduce_grads_and_step(mesh, monkeypatch, local_step):
    gen = torch.Generator().manual_seed(0)
    weights = [_ints(gen) for _ in CASES]
    grads = [_ints(gen) for _ in CASES]
    gl = [
        None if c[2] is None else locals_of(g, c[2][1] if c[2][0] == "main" else c[2], SIZES, gen)
        for g, c in zip(grads, CASES)
    ]
    world = SimWorld(SIZES, [mesh.get_group(i).group_name for i in range(len(SIZES))])
    world.patch(monkeypatch)

    def rank(_r, c):
        pairs, keys = [], []
        for j, (ppl, pdt, gpl, mpl, key) in enumerate(CASES):
            p = nn.Parameter(_dt(mesh, locals_of(weights[j], ppl, SIZES, gen)[c].to(pdt).clone(), ppl))
            m = (
                p
                if mpl is None
                else nn.Parameter(_dt(mesh, locals_of(weights[j], mpl[0], SIZES, gen)[c].to(mpl[1]).clone(), mpl[0]))
            )
            if gpl is not None and gpl[0] == "main":
                setattr(p, main_grad.ATTR, _dt(mesh, gl[j][c].to(f32), gpl[1]))
            elif gpl is not None:
                p.grad = _dt(mesh, gl[j][c].to(pdt), gpl)
            pairs.append((f"p{j}", p, m))
            keys.append(key)
        opt = object.__new__(optim.ShardedOptimizer)  # only what reduce_grads and step read
        opt.__dict__.update(
            _pairs=pairs,
            _keys=keys,
            _ready=False,
            _local_step=local_step,
            _locals={},
            _wrapped={},
            inner=torch.optim.SGD([m for _f, _p, m in pairs], lr=1.0),
            mesh=mesh,
            offload=None,
            early=None,
            grad_offload=None,
            _usage_groups=(),  # every rank runs the same program here (NOTE [unused parameters])
        )
        opt.reduce_grads()
        n_reduce = len(world.log[_r])
        reduced = [
            None if m.grad is None else (m.grad._local_tensor.clone(), tuple(m.grad.placements), m.grad.dtype)
            for _f, _p, m in pairs
        ]
        released = [main_grad.get(p) is None for _f, p, _m in pairs]
        opt.reduce_grads()  # once per step: nothing more
        assert len(world.log[_r]) == n_reduce
        opt.step()
        return SimpleNamespace(reduced=reduced, released=released, n_reduce=n_reduce, pairs=pairs, ready=opt._ready)

    for r, res in enumerate(world.run(rank)):
        c = world.coords[r]
        for j, (ppl, pdt, gpl, mpl, key) in enumerate(CASES):
            _f, p, m = res.pairs[j]
            if mpl is None:  # its own master: reduce_grads leaves it to the bucket's reduction
                assert res.reduced[j][1] == ppl
                continue
            if gpl is None:
                assert res.reduced[j] is None and torch.equal(
                    p._local_tensor, locals_of(weights[j], ppl, SIZES, gen)[c].to(pdt)
                )
                continue
            g, pl, dt = res.reduced[j]
            assert pl == mpl[0] and dt == mpl[1], j
            assert torch.equal(g, locals_of(grads[j], mpl[0], SIZES, gen)[c].to(dt)), (r, j)
            if gpl[0] == "main" and gpl[1] != mpl[0]:
                assert res.released[j], j  # a main gradient is released once reduced
            # the step: master -= grad; the parameter is its block of the new master, in its dtype
            new = weights[j] - grads[j]
            assert torch.equal(m._local_tensor, locals_of(new, mpl[0], SIZES, gen)[c].to(mpl[1])), (r, j)
            assert p.dtype == pdt and torch.equal(p._local_tensor, locals_of(new, ppl, SIZES, gen)[c].to(pdt)), (r, j)
        assert not res.ready  # the next step reduces again
        # reduce: per chunk, per kind and mesh dim, one collective (chunk 0: cases 0, 1, 5; chunk 1:
        # cases 2 and 8); step: all-gathers, inner dim first, one per chunk and dtype
        ops = [(op, world.groups.index(g), shape[0]) for op, g, _x, shape, _dt_ in world.log[r]]
        # (chunk 1's first reduce-scatter is issued while chunk 0's is in flight: NOTE [reductions
        # in flight]; each chunk's later moves once its first has landed)
        assert ops[: res.n_reduce] == [
            ("reduce_scatter", 0, 16 + 16),
            ("reduce_scatter", 0, 16),
            ("reduce_scatter", 1, 8 + 16),
            ("all_reduce", 0, 8),
            ("reduce_scatter", 1, 8 + 16),
            ("all_reduce", 0, 8),
        ]
        # (chunk by chunk, per dtype: chunk 1's first gathers while chunk 0's are in flight)
        assert ops[res.n_reduce :] == [
            ("all_gather", 1, 4),
            ("all_gather", 1, 8),
            ("all_gather", 1, 4),
            ("all_gather", 1, 8),
            ("all_gather", 0, 8),
            ("all_gather", 0, 8 + 8),
            ("all_gather", 0, 8),
            ("all_gather", 0, 8),
        ]
