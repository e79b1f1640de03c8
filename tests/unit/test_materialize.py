"""``lowering.materialize`` on fake meshes where this process is each rank in turn: every
rank's shards, put together, must be the one-device model's weights.

The one-device reference is written here from the documented init contract: a fresh CPU
model whose modules' ``init_weights(generator)`` run in ``named_modules`` order on one
generator seeded with the seed, each drawing in float32.  The model is a user's: two
modules with their own init, a parameter of another dtype, a tied head, and a frozen
parameter.  Checked: the shards (from meta with a seed, and sliced from real weights),
their dtype and ``requires_grad``, the masters' initial blocks in float32 before rounding to
bf16 storage, a tie re-pointed to one sharded Parameter, parameters another pipeline stage
holds left Absent, and a meta parameter with no init refused by name."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import meshlm
from harness.simworld import fake_mesh
from meshlm.layout.rules import load_layout
from meshlm.runtime import main_grad
from meshlm.runtime.absent import Absent
from meshlm.runtime.lowering.materialize import materialize
from meshlm.runtime.lowering.params import plan_params

f32, bf16 = torch.float32, torch.bfloat16


class Inner(nn.Module):
    param_axes: ClassVar = {"w": ("embed", "mlp"), "scale": ("mlp",)}

    def __init__(self, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 6, device=device))
        self.scale = nn.Parameter(torch.empty(6, device=device), requires_grad=False)

    def init_weights(self, gen):
        nn.init.normal_(self.w, generator=gen)
        nn.init.uniform_(self.scale, 0.5, 1.5, generator=gen)


class Model(nn.Module):
    param_axes: ClassVar = {"emb": ("vocab", "embed"), "mix": ("embed", "embed2")}
    logical_axes: ClassVar = {"embed2": "the width of a second projection"}

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(12, 8, device=device))
        self.mix = nn.Parameter(torch.empty(8, 4, device=device, dtype=torch.float64))
        self.inner = Inner(device)
        self.head = nn.Linear(8, 12, bias=False, device=device)
        self.head.weight = self.emb  # tied
        self.head.param_axes = {"weight": ("vocab", "embed")}

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)
        nn.init.normal_(self.mix, generator=gen)


def _reference(seed):
    m = Model()
    gen = torch.Generator().manual_seed(seed)
    for mod in [mod for _n, mod in m.named_modules()]:
        if hasattr(mod, "init_weights"):
            with torch.no_grad():
                mod.init_weights(gen)
    return {n: p.detach() for n, p in m.named_parameters()}


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


SHAPE = {"dp": 2, "fsdp": 2}


def _ranks():
    for rank in range(4):
        yield rank, fake_mesh(SHAPE, rank)


def _whole(parts, placements):
    """The full tensor from every rank's local tensor (rank order over dp then fsdp)."""
    (dp_pl, fsdp_pl) = placements
    rows = []
    for d in range(2):
        pair = [parts[d * 2 + f] for f in range(2)]
        rows.append(torch.cat(pair, fsdp_pl.dim) if isinstance(fsdp_pl, Shard) else pair[0])
    return torch.cat(rows, dp_pl.dim) if isinstance(dp_pl, Shard) else rows[0]


@pytest.mark.parametrize("source", ["seed", "weights"])
def test_every_ranks_shards_make_the_one_device_weights(source):
    ref = _reference(7)
    parts: dict[str, list] = {}
    for _rank, mesh in _ranks():
        if source == "seed":
            model, seed = Model(device="meta"), 7
        else:
            model, seed = Model(), None
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(ref[n])
        plans = plan_params(model, load_layout("fsdp"), mesh)
        materialize(model, plans, mesh, seed)
        assert model.head.weight is model.emb  # the tie: one sharded Parameter
        for n, p in model.named_parameters():
            assert isinstance(p.data, DTensor) and p.dtype == ref[n].dtype and p.shape == ref[n].shape, n
            assert p.requires_grad == (n != "inner.scale")
            parts.setdefault(n, []).append((p._local_tensor.clone(), tuple(p.placements)))
    for n, got in parts.items():
        pls = {pl for _t, pl in got}
        assert len(pls) == 1
        assert torch.equal(_whole([t for t, _pl in got], pls.pop()), ref[n]), n
    assert set(parts) == {"emb", "mix", "inner.w", "inner.scale"}


def test_bf16_storage_keeps_the_float32_init_as_the_masters():
    ref = _reference(3)
    masters: dict[str, list] = {}
    for _rank, mesh in _ranks():
        model = Model(device="meta")
        plans = plan_params(model, load_layout("zero2"), mesh)
        materialize(model, plans, mesh, 3, param_dtype=bf16, master_dtype=f32)
        for n, p in model.named_parameters():
            assert p.dtype == bf16 and torch.equal(p._local_tensor, ref[n].to(bf16)), n  # zero2 stores whole
            init = getattr(p, main_grad.INIT_MASTER, None)
            if not p.requires_grad:
                assert init is None, n  # frozen: no master
                continue
            # the optimizer's placements: embed over dp and fsdp, a quarter on each rank
            assert init.dtype == f32 and init._local_tensor.numel() * 4 == ref[n].numel(), n
            masters.setdefault(n, []).append((init._local_tensor.clone(), tuple(init.placements)))
    for n, got in masters.items():
        assert torch.equal(_whole([t for t, _pl in got], got[0][1]), ref[n].to(f32)), n


def test_parameters_of_another_stage_are_absent_and_the_draws_unchanged():
    ref = _reference(5)
    mesh = fake_mesh(SHAPE)
    model = Model(device="meta")
    materialize(model, plan_params(model, load_layout("ddp"), mesh), mesh, 5, keep={"inner.w", "inner.scale"})
    assert isinstance(model.emb, Absent) and isinstance(model.head.weight, Absent) and isinstance(model.mix, Absent)
    assert [n for n, _p in model.named_parameters()] == ["inner.w", "inner.scale"]
    # drawn after emb and mix, which were still drawn: the one-device values
    assert torch.equal(model.inner.w._local_tensor, ref["inner.w"])


def test_meta_without_init_and_uninitialised_shards():
    mesh = fake_mesh(SHAPE, rank=1)

    class NoInit(nn.Module):
        param_axes: ClassVar = {"w": ("embed", "mlp"), "frozen": ("mlp",)}

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 4, device="meta"))
            self.frozen = nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)

    m = NoInit()
    plans = plan_params(m, load_layout("fsdp"), mesh)
    with pytest.raises(meshlm.MeshlmError) as e:
        materialize(m, plans, mesh, 0)
    assert str(e.value) == (
        "parameter `w` is on the meta device but NoInit has no init_weights(generator): define it to fill the "
        "module's own parameters, or build the model with real weights."
    )
    m = NoInit()
    materialize(m, plans, mesh, None, param_dtype=bf16)  # no seed: this rank's shard allocated, not filled
    assert m.w._local_tensor.shape == (2, 4) and m.w.dtype == bf16 and m.w.shape == (8, 4)
    assert tuple(m.w.placements) == (Shard(0), Shard(0)) and m.w.stride() == (4, 1)
    assert m.w.requires_grad and not m.frozen.requires_grad


def test_a_slot_left_unsharded_is_an_internal_error_by_name():
    from meshlm.runtime.lowering.materialize import _check_no_shared_params

    mesh = fake_mesh(SHAPE)
    model = Model(device="meta")
    materialize(model, plan_params(model, load_layout("ddp"), mesh), mesh, 1)
    _check_no_shared_params(model)  # every slot sharded
    model.inner.register_parameter("stray", nn.Parameter(torch.zeros(2)))
    with pytest.raises(meshlm.MeshlmError) as e:
        _check_no_shared_params(model)
    assert str(e.value) == (
        "internal error: parameter `inner.stray` was left unsharded by meshlm.shard (a slot of a tied "
        "parameter, NOTE [ties] in meshlm/core/ties.py, not re-pointed)"
    )
