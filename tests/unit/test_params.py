"""``lowering.params``: where each parameter lives, and the placements and local blocks that
says, against references written here from the layouts' meaning (not from meshlm's resolver).

- ``plan_params`` on a user's model under the shipped data-parallel layouts, each section's
  plan written out by hand from the layout file; a tied parameter planned once; errors name
  the parameter and the layout section whose rule does not fit.
- ``placements``: Shard(d) on every mesh dim whose axis shards tensor dim d, else Replicate.
- ``local_box`` / ``local_slice`` on fake meshes where this process is each rank in turn,
  against the block DTensor's placements mean (``chunk`` per mesh dim, outer to inner), for
  random shapes and placements (hypothesis).
- ``pure_data_parallel``, ``needs_regather``, ``ParamPlan.local_shape``, ``mesh_sizes``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import meshlm
from harness.simworld import fake_mesh
from meshlm.core.errors import LayoutError
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.rules import load_layout, parse_layout
from meshlm.runtime.lowering import params as P

R = Replicate()


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Net(nn.Module):
    """A user's model: an embedding tied to the head, a projection, a bias, a None slot."""

    param_axes: ClassVar = {"emb": ("vocab", "embed"), "proj": ("embed", "mlp"), "bias": ("mlp",)}

    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.zeros(16, 8))
        self.proj = nn.Parameter(torch.zeros(8, 12))
        self.bias = nn.Parameter(torch.zeros(12, dtype=torch.bfloat16))
        self.head = Head(self.emb)
        self.register_parameter("unused", None)


class Head(nn.Module):
    param_axes: ClassVar = {"weight": ("vocab", "embed")}

    def __init__(self, w):
        super().__init__()
        self.weight = w


DP = ("dp", "fsdp")
SIZES = {"dp": 2, "fsdp": 2}


@pytest.mark.parametrize(
    "layout, storage, grads, optimizer",
    [
        # (per parameter emb, proj, bias: the mesh axes of each dim) from the layout files
        ("ddp", [((), ()), ((), ()), ((),)], [((), ()), ((), ()), ((),)], [((), ()), ((), ()), ((),)]),
        ("fsdp", [((), DP), (DP, ()), ((),)], [((), DP), (DP, ()), ((),)], [((), DP), (DP, ()), ((),)]),
        ("zero1", [((), ()), ((), ()), ((),)], None, [((), DP), (DP, ()), ((),)]),
        ("zero2", [((), ()), ((), ()), ((),)], [((), DP), (DP, ()), ((),)], [((), DP), (DP, ()), ((),)]),
        ("hsdp", [((), ("fsdp",)), (("fsdp",), ()), ((),)], None, None),
    ],
)
def test_each_section_is_planned_from_its_rules(layout, storage, grads, optimizer):
    plans = P.plan_params(Net(), load_layout(layout), SIZES)
    assert list(plans) == ["emb", "proj", "bias"]  # the tied head weight: once, under its first name
    grads = storage if layout == "hsdp" else grads
    optimizer = storage if layout == "hsdp" else optimizer
    for j, (fqn, pp) in enumerate(plans.items()):
        assert pp.fqn == fqn and pp.axes == Net.param_axes[fqn]
        assert pp.shape == tuple(getattr(Net(), fqn).shape) and pp.dtype == getattr(Net(), fqn).dtype
        assert pp.storage == storage[j], fqn
        assert pp.compute == tuple(() for _ in pp.shape), fqn  # data parallel: whole in compute
        assert pp.grads == (None if grads is None else grads[j]), fqn
        assert pp.optimizer == optimizer[j], fqn


def test_a_rule_that_does_not_fit_names_the_parameter_and_the_section():
    net = Net()
    cases = [
        ({"params": {"mlp": "fsdp"}, "compute": {}}, {"fsdp": 8}, "params.mlp"),
        ({"params": {}, "compute": {"mlp": "fsdp"}}, {"fsdp": 8}, "compute.mlp"),
        ({"params": {}, "grads": {"mlp": "fsdp"}, "compute": {}}, {"fsdp": 8}, "grads.mlp"),
        ({"params": {}, "grads": "local", "optimizer": {"mlp": "fsdp"}, "compute": {}}, {"fsdp": 8}, "optimizer.mlp"),
        # grads checked on their own, not only through an optimizer that follows them
        ({"params": {}, "grads": {"mlp": "fsdp"}, "optimizer": {}, "compute": {}}, {"fsdp": 8}, "grads.mlp"),
    ]
    for data, sizes, where in cases:
        with pytest.raises(LayoutError) as e:
            P.plan_params(net, parse_layout(data, name="bad"), sizes)
        assert str(e.value).startswith("param `proj` ") and f"in <dict>: {where}" in str(e.value), str(e.value)


def test_placements_shard_each_mesh_dim_over_the_tensor_dim_it_splits():
    names = ("dp", "fsdp", "tp")
    assert P.placements(((), ("dp", "fsdp"), ("tp",)), names) == (Shard(1), Shard(1), Shard(2))
    assert P.placements((("tp",), ()), names) == (R, R, Shard(0))
    assert P.placements(((), ()), names) == (R, R, R)
    assert P.placements((("cp",),), names) == (R, R, R)  # an axis not on this mesh


MESHES = [{"dp": 2}, {"dp": 2, "fsdp": 2}, {"dp": 2, "tp": 2}, {"fsdp": 2, "tp": 2}]


def _reference_block(full, mesh_shape, coords, pl):
    """DTensor's meaning: for each mesh dim, outer to inner, a Shard(d) keeps chunk ``coord``
    of ``size`` equal chunks along d."""
    t = full
    for (_name, size), c, p in zip(mesh_shape.items(), coords, pl):
        if isinstance(p, Shard):
            t = t.chunk(size, p.dim)[c]
    return t


@settings(max_examples=40, deadline=None)
@given(
    mesh_i=st.integers(0, len(MESHES) - 1),
    dims=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    choice=st.lists(st.integers(-1, 2), min_size=2, max_size=2),
)
def test_local_box_is_this_ranks_block(mesh_i, dims, choice):
    mesh_shape = MESHES[mesh_i]
    n_mesh = len(mesh_shape)
    pl = tuple(R if c < 0 or c >= len(dims) else Shard(c) for c in choice[:n_mesh])
    # every sharded dim divisible by the product of the mesh dims that shard it
    shape = list(dims)
    for d in range(len(dims)):
        k = math.prod(s for s, p in zip(mesh_shape.values(), pl) if p == Shard(d))
        shape[d] *= k
    full = torch.arange(math.prod(shape)).view(shape)
    world = math.prod(mesh_shape.values())
    for rank in range(world):
        mesh = fake_mesh(mesh_shape, rank)
        coords = [mesh.get_local_rank(i) for i in range(n_mesh)]
        want = _reference_block(full, mesh_shape, coords, pl)
        got = P.local_slice(full, mesh, pl)
        assert torch.equal(got, want), (mesh_shape, pl, rank)
        box = P.local_box(shape, mesh, pl)
        assert [n for _s, n in box] == list(want.shape)
        assert torch.equal(full[tuple(slice(s, s + n) for s, n in box)], want)


def test_local_box_refuses_an_uneven_shard():
    mesh = fake_mesh({"dp": 2, "fsdp": 2})
    with pytest.raises(LayoutError) as e:
        P.local_box((6, 3), mesh, (Shard(0), Shard(0)))
    assert str(e.value) == "dim 0 of size 6 is not divisible by mesh axes ['dp', 'fsdp'] (size 4)"
    assert P.local_box((6, 4), mesh, (Shard(0), Shard(1))) == [(0, 3), (0, 2)]


def test_pure_data_parallel_is_batch_over_every_mesh_axis_and_nothing_else():
    cases = [
        ("ddp", {"dp": 2, "fsdp": 2}, True),
        ("fsdp", {"fsdp": 4}, True),  # storage may shard; compute is what counts
        ("ddp", {"dp": 2, "tp": 1}, True),  # a size-1 axis is no axis
        ("ddp", {"dp": 1}, True),  # one device
        ("ddp", {"dp": 2, "tp": 2}, False),  # tp does not split the batch
        ("tp", {"tp": 2}, False),
        (parse_layout({"params": {}, "compute": {"batch": "dp"}}), {"dp": 2, "fsdp": 2}, False),
        (parse_layout({"params": {}, "compute": {"batch": ["dp", "fsdp"], "seq": "fsdp"}}), {"fsdp": 2}, False),
        (parse_layout({"params": {}, "compute": {"batch": ["dp", "fsdp"], "mlp": "tp"}}), {"fsdp": 2}, True),
    ]
    for layout, sizes, want in cases:
        lay = load_layout(layout) if isinstance(layout, str) else layout
        assert P.pure_data_parallel(lay, sizes) is want, (layout, sizes)


def _plan(storage, compute):
    return P.ParamPlan("w", ("a", "b"), (8, 4), torch.float32, storage, compute, None, storage)


def test_needs_regather_when_storage_shards_a_data_axis_compute_does_not():
    assert P.needs_regather(_plan((("fsdp",), ()), ((), ())))
    assert P.needs_regather(_plan(((), ("dp",)), ((), ())))
    assert P.needs_regather(_plan((("dp", "fsdp"), ()), (("dp",), ())))
    assert not P.needs_regather(_plan((("tp",), ()), ((), ())))  # not a data axis
    assert not P.needs_regather(_plan((("fsdp",), ()), (("fsdp",), ())))  # kept sharded in compute
    assert not P.needs_regather(_plan(((), ()), ((), ())))


def test_local_shape_divides_by_the_sizes_of_the_axes_present():
    pp = _plan((("dp", "fsdp"), ("tp",)), ((), ()))
    assert pp.local_shape(pp.storage, {"dp": 2, "fsdp": 2, "tp": 2}) == (2, 2)
    assert pp.local_shape(pp.storage, {"dp": 2}) == (4, 4)  # axes not on the mesh count as 1
    assert pp.local_shape(pp.compute, {"dp": 2, "tp": 4}) == (8, 4)


def test_mesh_sizes_of_each_kind_of_mesh():
    assert P.mesh_sizes({"dp": 2, "tp": 2}) == {"dp": 2, "tp": 2}
    assert P.mesh_sizes(MeshSpec.parse({"dp": 2, "tp": 2}, 4)) == {"dp": 2, "tp": 2}
    mesh = meshlm.make_mesh({"dp": 2, "tp": 2}, fake=True)
    assert P.mesh_sizes(mesh) == {"dp": 2, "tp": 2}


def test_iter_params_yields_each_parameter_once():
    net = Net()
    got = [(fqn, type(m).__name__, name) for fqn, m, name, _p in P.iter_params(net)]
    assert got == [("emb", "Net", "emb"), ("proj", "Net", "proj"), ("bias", "Net", "bias")]


class Deep(nn.Module):
    """A None slot and a repeated parameter before others in the same module, and a
    submodule's parameters (named by their path)."""

    param_axes: ClassVar = {"w": ("embed",)}

    def __init__(self):
        super().__init__()
        self.register_parameter("none", None)
        self.sub = Net()
        self.again = self.sub.proj
        self.w = nn.Parameter(torch.zeros(8))


def test_iter_params_names_submodule_parameters_by_path_and_skips_repeats():
    got = [fqn for fqn, _m, _n, _p in P.iter_params(Deep())]
    # "again" is sub.proj, seen first under its name in Deep: once, under that name
    assert got == ["again", "w", "sub.emb", "sub.bias"]


def test_a_layout_key_no_axis_has_names_the_model():
    with pytest.raises(meshlm.MeshlmError) as e:
        P.plan_params(Net(), parse_layout({"params": {"embd": "fsdp"}, "compute": {}}, name="bad"), {"fsdp": 2})
    assert "nor declared by model Net (it declares none)" in str(e.value)


class Wide(nn.Module):
    """A model that declares a logical axis of its own and shards it."""

    logical_axes: ClassVar = {"taps": "the filter taps"}
    param_axes: ClassVar = {"f": ("taps", "embed")}

    def __init__(self):
        super().__init__()
        self.f = nn.Parameter(torch.zeros(4, 8))


def test_a_declared_axis_is_planned_like_a_standard_one():
    plans = P.plan_params(Wide(), parse_layout({"params": {"taps": "fsdp"}, "compute": {}}), {"fsdp": 2})
    assert plans["f"].storage == (("fsdp",), ()) and plans["f"].compute == ((), ())
    # declared but not in the layout: replicated everywhere, not refused
    plans = P.plan_params(Wide(), load_layout("ddp"), {"dp": 2})
    assert plans["f"].storage == plans["f"].grads == plans["f"].optimizer == ((), ())
    zero2 = parse_layout({"params": {}, "grads": {"taps": "fsdp"}, "compute": {}})
    plans = P.plan_params(Wide(), zero2, {"fsdp": 2})
    assert plans["f"].grads == (("fsdp",), ()) == plans["f"].optimizer and plans["f"].storage == ((), ())


def test_full_state_dict_gives_plain_whole_tensors():
    mesh = meshlm.make_mesh({"dp": 2}, fake=True)
    net = Net()
    # a replicated DTensor parameter: its full tensor is its local one (no data moves)
    w = torch.arange(12.0).view(3, 4)
    net.proj = nn.Parameter(DTensor.from_local(w, mesh, (R,), run_check=False))
    got = P.full_state_dict(net)
    assert list(got) == ["emb", "proj", "bias"]
    assert type(got["proj"]) is torch.Tensor and torch.equal(got["proj"], w)
    assert type(got["emb"]) is torch.Tensor and not got["emb"].requires_grad
