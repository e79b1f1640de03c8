"""Scoped layouts (NOTE [scoped layouts] in meshlm/core/scopes.py): parsing, which rules each
parameter gets, and the errors for scopes that cannot apply (no process group needed:
plan_params takes mesh sizes)."""

import pytest
import torch
from torch import nn

import meshlm
from meshlm import nn as mnn
from meshlm.core.errors import LayoutError
from meshlm.layout.rules import parse_layout
from meshlm.runtime.lowering import plan_params, pure_data_parallel

MESH = {"fsdp": 2, "tp": 2}
TOP = {"params": {"embed": "fsdp", "mlp": "tp"}, "compute": {"batch": ["dp", "fsdp"], "mlp": "tp"}}


@meshlm.block
class Block(nn.Module):
    def __init__(self, d: int, device=None):
        super().__init__()
        self.up = mnn.Linear(d, 2 * d, axes=("embed", "mlp"), device=device)

    def forward(self, x):
        return self.up(x)


class Tower(nn.Module):
    def __init__(self, d: int, device=None):
        super().__init__()
        self.norm = mnn.LayerNorm(d, device=device)
        self.blocks = nn.ModuleList([Block(d, device)])


class Model(nn.Module):
    def __init__(self, device="meta"):
        super().__init__()
        self.vision = Tower(8, device)
        self.language = Tower(16, device)


def lay(scopes, **top):
    return parse_layout({**TOP, **top, "scopes": scopes}, source="t.yaml")


def plans(layout):
    return plan_params(Model(), layout, MESH)


def test_each_parameter_gets_its_scopes_rules():
    p = plans(lay({"vision": "single"}))
    assert p["vision.blocks.0.up.weight"].storage == ((), ())
    assert p["vision.norm.weight"].storage == ((),)
    assert p["language.blocks.0.up.weight"].storage == (("tp",), ("fsdp",))
    p = plans(lay({"vision": {"params": {"embed": "fsdp"}}}))
    # an inline section replaces the top level's: mlp is no longer sharded in storage ...
    assert p["vision.blocks.0.up.weight"].storage == ((), ("fsdp",))
    # ... and the sections it leaves out are the top level's
    assert p["vision.blocks.0.up.weight"].compute == (("tp",), ())


def test_a_scope_layout_by_name_and_its_description_stays_the_top_levels():
    layout = lay({"vision": "tp", "language": "fsdp"})
    assert [s.path for s in layout.scopes] == ["vision", "language"]
    assert layout.for_path("vision.blocks.0.up.weight").name == "tp"
    assert layout.for_path("visionary.x") is layout  # a path prefix only at a module boundary
    assert {"tp", "fsdp", "dp"} <= layout.mesh_axes_used()


def test_pure_data_parallel_needs_every_scope():
    sizes = {"fsdp": 2}
    assert pure_data_parallel(lay({"vision": "ddp"}, compute={"batch": ["dp", "fsdp"]}), sizes)
    assert not pure_data_parallel(lay({"vision": "single"}, compute={"batch": ["dp", "fsdp"]}), sizes)


@pytest.mark.parametrize(
    "scopes,match",
    [
        ({"visoin": "fsdp"}, r"no submodule `visoin`.*did you mean 'vision'"),
        ({"vision": "fsdp", "vision.blocks": "tp"}, r"scopes `vision` and `vision.blocks` overlap"),
        ({"vision.blocks.0": "fsdp"}, r"`vision.blocks.0` is a block"),
        ({"vision.blocks.0.up": "fsdp"}, r"inside block `vision.blocks.0`"),
        ({"vision": {"params": {"heads": "tp"}}}, r"scopes.vision: params.heads: no parameter under `vision`"),
        ({"vision": {"compute": {"kv_heads": "tp"}}}, r"compute.kv_heads: no parameter under `vision`"),
    ],
)
def test_scopes_that_cannot_apply_are_errors(scopes, match):
    with pytest.raises(LayoutError, match=match):
        plans(lay(scopes))


def test_an_inline_scope_may_map_activation_axes_and_null_rules():
    plans(lay({"vision": {"compute": {"batch": "fsdp", "patch": None}, "params": {"heads": None}}}))


@pytest.mark.parametrize(
    "scopes,top,match",
    [
        ({"vision": {"grads": "local"}}, {}, r"`grads: local`.*whole-model choice"),
        ({"vision": "zero1"}, {}, r"`grads: local`"),
        ({"vision": "fsdp_pp"}, {}, r"`layers: pp`"),
        ({"vision": "fsdp"}, {"params": {"layers": "pp"}}, r"`layers: pp`"),
        ({"vision": {"scopes": {}}}, {}, r"cannot have scopes of its own"),
        ({"vision": {"offload": {"optimizer": "host"}}}, {}, r"offload is set for the whole model"),
        ({"vision": 3}, {}, r"expected a layout name or a mapping"),
        ({"vision": "nonesuch"}, {}, r"unknown layout 'nonesuch'"),
        (["vision"], {}, r"scopes maps submodule paths"),
        ({"vision/x": "fsdp"}, {}, r"not a submodule path"),
    ],
)
def test_bad_scopes_are_layout_errors(scopes, top, match):
    with pytest.raises(LayoutError, match=match):
        lay(scopes, **top)


def test_a_scoped_model_runs_on_one_device():
    """Without a mesh, scopes change nothing: the model is plain PyTorch."""
    m = Model(device="cpu")
    x = torch.randn(2, 8)
    assert m.vision.blocks[0](x).shape == (2, 16)
