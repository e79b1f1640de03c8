"""The sharded root's forward (``lowering.root.root_forward``) on a fake dp x tp mesh: which
path a call takes (the DTensor root, or the local root of NOTE [local root]), what the
user's forward receives and what the caller gets back.

The model is a user's, not one of meshlm's: its forward takes a dict batch, extra
positional arguments, a keyword-only argument and ``**kwargs``, declares the axes of two
input leaves by path, constrains an activation, and returns a loss with other tensors and
non-tensors.  It records what it is given.  The fake group's collectives move no data, so
values are not compared here (the multi-process tests compare them with one device); what
is checked is what the root decides: every tensor leaf of the inputs becomes a DTensor
placed by the input rules for its declared (or default) axes, a DTensor input is passed as
it is, ``constrain`` is active, a 0-d output comes back as a plain tensor and every other
output as it was, and the counters and flags say which root ran.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import meshlm
from harness.simworld import patch_replicas

R, S0, S1 = Replicate(), Shard(0), Shard(1)
B, F_IN, H = 4, 6, 8  # this rank's rows, features, hidden (sharded over tp under tp)


class Box:
    """An object meshlm cannot look inside, holding a tensor: returned as it is."""

    def __init__(self, t):
        self.t = t


def _what(v):
    """A DTensor's placements and global shape, else the type."""
    return (tuple(v.placements), tuple(v.shape)) if isinstance(v, DTensor) else type(v)


class Tagger(nn.Module):
    param_axes: ClassVar = {"w": ("embed", "mlp")}
    input_axes: ClassVar = {"batch.mask": ("batch",), "weights": (None, "batch")}

    def __init__(self, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(F_IN, H, device=device))
        self.seen: list[dict] = []

    def init_weights(self, gen):
        nn.init.normal_(self.w, generator=gen)

    def forward(self, batch, *extra, scale=1.0, **opts):
        leaves = {"batch.feats": batch["feats"], "batch.mask": batch["mask"], "extra": extra[0], **opts}
        self.seen.append({k: _what(v) for k, v in leaves.items()})
        h = meshlm.constrain(batch["feats"] @ self.w, ("batch", None))  # gathered over tp
        self.seen[-1]["h"] = _what(h)
        loss = meshlm.reduce_batch((h * batch["mask"][:, None]).sum() * scale, "sum")
        return {"loss": loss, "h": h, "note": "text", "raw": Box(h), "none": None}


@pytest.fixture
def model(monkeypatch, request):
    layout, mesh_shape = request.param
    mesh = meshlm.make_mesh(mesh_shape, fake=True)
    patch_replicas(monkeypatch)
    m = meshlm.shard(Tagger(device="meta"), layout, mesh, seed=0)
    yield m, mesh
    if dist.is_initialized():
        dist.destroy_process_group()


def _call(m, given=None, **opts):
    g = torch.Generator().manual_seed(0)
    batch = {"feats": torch.randn(B, F_IN, generator=g), "mask": torch.ones(B)}
    extra = torch.randn(B, 3, generator=g)
    return m(batch, extra, scale=2.0, given=given if given is not None else torch.zeros(B, 2), **opts)


TP = ("tp", {"dp": 2, "tp": 2})
DDP = ("ddp", {"dp": 2, "fsdp": 2})


@pytest.mark.parametrize("model", [TP], indirect=True)
def test_the_dtensor_root_wraps_every_input_leaf_by_its_axes(model):
    m, mesh = model
    given = DTensor.from_local(torch.zeros(B, 2), mesh, (R, S1), run_check=False)
    out = _call(m, given, weights=torch.rand(2, B))
    (seen,) = m.seen
    # batch over dp; the declared leaves by their path, the rest ("batch", "seq", ...) by default
    # (the global shapes: this rank's rows times dp)
    assert seen == {
        "batch.feats": ((S0, R), (2 * B, F_IN)),
        "batch.mask": ((S0, R), (2 * B,)),
        "extra": ((S0, R), (2 * B, 3)),
        "weights": ((S1, R), (2, 2 * B)),
        "given": ((R, S1), (B, 2 * 2)),  # a DTensor input as it was given
        "h": ((S0, R), (2 * B, H)),  # constrain active: the matmul's (S0, S1) gathered
    }
    assert type(out["loss"]) is torch.Tensor and out["loss"].ndim == 0  # the 0-d output whole
    assert isinstance(out["h"], DTensor) and tuple(out["h"].placements) == (S0, R)
    assert (out["note"], out["none"]) == ("text", None) and isinstance(out["raw"].t, DTensor)
    st = m._meshlm_state
    assert st.local_now is False and st.roots["dtensor"] == 1
    _call(m)
    assert st.roots["dtensor"] == 2 and len(m.seen) == 2


@pytest.mark.parametrize("model", [DDP], indirect=True)
def test_a_data_parallel_layout_runs_the_local_root_only_with_gradients(model):
    """Under ddp a training call runs on local rows; an evaluation call (no_grad) runs
    under DTensor."""
    m, mesh = model
    st = m._meshlm_state
    with torch.no_grad():
        out = _call(m)
    assert st.local_now is False and st.roots["dtensor"] == 1
    assert m.seen[-1]["batch.feats"] == ((S0, S0), (4 * B, F_IN))  # batch over dp and fsdp
    assert m.seen[-1]["h"] == ((S0, S0), (4 * B, H))
    assert type(out["loss"]) is torch.Tensor and out["loss"].ndim == 0
    _call(m)
    assert st.local_now is True and st.roots == {"local": 1, "dtensor": 1}
    assert m.seen[-1]["batch.feats"] is torch.Tensor  # this rank's rows, plain
    # An input whose batch is not its first dim cannot run on local rows: the DTensor root.
    _call(m, weights=torch.rand(2, B))
    assert st.local_now is False and st.roots == {"local": 1, "dtensor": 2}
    assert m.seen[-1]["weights"] == ((S1, S1), (2, 4 * B))


@pytest.mark.parametrize("model", [TP], indirect=True)
def test_input_axes_of_the_wrong_length_are_refused_by_path(model):
    m, _mesh = model
    m.input_axes = {"batch.mask": ("batch", None)}  # an instance attribute counts too
    with pytest.raises(meshlm.MeshlmError) as e:
        _call(m)
    assert str(e.value) == (
        "Tagger.input_axes['batch.mask'] = ('batch', None) names 2 axes for an input of 1 dims: "
        "give one logical axis (or None) per dim"
    )
    assert m.seen == []  # refused before the user's forward ran
