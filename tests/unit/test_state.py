"""``lowering.state.ShardState`` on fake meshes: the plain copies of the mesh it keeps for
traced code (sizes, names, this rank's coordinate), the placements of activations and
inputs under the layout's compute rules (inputs split over the data and cp axes only),
``constrain`` (through redistribute always, so a Partial gradient is reduced where the
constraint is), and ``shard_state``'s error for a module that was never sharded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import meshlm
from harness.simworld import fake_mesh
from meshlm.layout.rules import load_layout
from meshlm.runtime.lowering.state import ShardState, shard_state

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _state(layout="tp", rank=0, shape=None):
    shape = shape or {"dp": 2, "tp": 2}
    mesh = fake_mesh(shape, rank)
    # the model's logical axes: standard ones and one it declares (NOTE [open vocabulary] in axes.py)
    vocab = frozenset({"batch", "seq", "embed", "mlp", "vocab", "taps"})
    return ShardState(load_layout(layout), mesh, {}, vocab=vocab)


def test_the_mesh_is_copied_as_plain_values():
    for rank, coord in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        st = _state(rank=rank)
        assert st.sizes == {"dp": 2, "tp": 2} and st.names == ("dp", "tp") and st.coord == coord
        assert st.handler.coord == coord and st.handler.sizes == (2, 2)
        assert st.roots == {"local": 0, "dtensor": 0} and st.local_now is False and st.gathered is None


def test_activation_and_input_placements_follow_the_compute_rules():
    st = _state()
    assert st.activation_placements(("batch", "seq", "mlp"), (4, 3, 8)) == (S0, Shard(2))
    assert st.activation_placements(("batch", None), (4, 3)) == (S0, R)
    assert st.activation_placements(("batch", "taps"), (4, 3)) == (S0, R)  # declared, not mapped
    assert st.placements(((), ("tp",))) == (R, S1)
    # inputs: the tp split of "vocab" is not applied (a tp group reads the same examples)
    assert st.input_placements(("batch", "vocab")) == (S0, R)
    assert st.input_placements(("batch", "taps")) == (S0, R)
    with pytest.raises(meshlm.MeshlmError) as e:
        st.input_placements(("batch", "vocab", "batch"))
    assert str(e.value).startswith("input ('batch', 'vocab', 'batch'): mesh axis 'dp' is used twice")
    assert "layouts/tp.yaml: compute.batch and compute.batch" in str(e.value)
    with pytest.raises(meshlm.MeshlmError) as e:
        st.activation_placements(("batch", "mlp"), (4, 3))
    assert "activation ('batch', 'mlp') of shape (4, 3)" in str(e.value) and "layouts/tp.yaml: compute.mlp" in str(
        e.value
    )


def test_constrain_redistributes_and_reduces_a_partial_gradient_there():
    st = _state()
    mesh = st.mesh
    x = DTensor.from_local(torch.ones(2, 4), mesh, (S0, R), run_check=False).requires_grad_()
    y = st.constrain(x, ("batch", None))  # already placed so: still a redistribute
    assert tuple(y.placements) == (S0, R) and y.grad_fn is not None and y is not x
    g = DTensor.from_local(torch.ones(2, 4), mesh, (S0, P), run_check=False)
    y.backward(g)
    assert tuple(x.grad.placements) == (S0, R)  # the Partial gradient reduced at the constraint
    z = st.constrain(DTensor.from_local(torch.ones(2, 4), mesh, (S0, R), run_check=False), ("batch", "mlp"))
    assert tuple(z.placements) == (S0, S1)
    # what annotate calls under the DTensor root is this constrain
    z = st.handler(DTensor.from_local(torch.ones(2, 4), mesh, (S0, R), run_check=False), ("batch", "mlp"))
    assert tuple(z.placements) == (S0, S1)
    with pytest.raises(meshlm.MeshlmError) as e:
        st.constrain(x, ("batch",))
    assert str(e.value) == (
        "constrain: 1 logical axes ('batch',) for a tensor of 2 dims (4, 4): give one logical axis (or None) per dim"
    )


def test_a_plain_tensor_passes_constrain_unchanged():
    st = _state()
    t = torch.ones(3)
    assert st.constrain(t, ("batch", "seq")) is t  # not a DTensor: not checked either


def test_shard_state_of_a_module_never_sharded():
    m = nn.Linear(2, 2)
    m._meshlm_state = st = _state()
    assert shard_state(m) is st
    with pytest.raises(meshlm.MeshlmError) as e:
        shard_state(nn.Linear(2, 2))
    assert str(e.value) == "this module was not lowered: call meshlm.shard(model, layout, mesh) first"
