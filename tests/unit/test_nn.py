"""The author's API without a process group: meshlm.nn layers, per-instance annotation, the
open vocabulary of logical axes (NOTE [open vocabulary] in meshlm/core/axes.py) and ties
(NOTE [ties] in meshlm/core/ties.py), checked through ``plan_params`` and ``init_params``."""

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm import nn as mnn
from meshlm.core.errors import AnnotationError, AxisError
from meshlm.layout.rules import load_layout, parse_layout
from meshlm.runtime.lowering import plan_params

TP = {"tp": 2}


class _Wrap(nn.Module):
    def __init__(self, **mods):
        super().__init__()
        for k, v in mods.items():
            setattr(self, k, v)


# --------------------------------------------------------------------------- meshlm.nn is torch's
@pytest.mark.parametrize(
    "make",
    [
        lambda: (nn.Linear(6, 10), mnn.Linear(6, 10, axes=("embed", "mlp"))),
        lambda: (nn.Linear(6, 10, bias=False), mnn.Linear(6, 10, bias=False, axes=("embed", "mlp"))),
        lambda: (nn.Embedding(12, 6, padding_idx=3), mnn.Embedding(12, 6, axes=("vocab", "embed"), padding_idx=3)),
        lambda: (nn.LayerNorm(6), mnn.LayerNorm(6)),
        lambda: (nn.LayerNorm(6, bias=False), mnn.LayerNorm(6, bias=False)),
        lambda: (nn.RMSNorm(6), mnn.RMSNorm(6)),
    ],
    ids=["linear", "linear_nobias", "embedding", "layernorm", "layernorm_nobias", "rmsnorm"],
)
def test_layers_are_torchs(make):
    """Same parameter names and shapes (so the same state_dict keys), the same forward, and
    init_weights(generator) draws torch's default initialisation from that generator."""
    torch.manual_seed(3)
    ref, _ = make()
    mine = make()[1]
    assert isinstance(mine, type(ref))
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    with torch.no_grad():
        for p in ref.parameters():  # make affine parameters non-trivial before comparing forwards
            p.add_(torch.randn(p.shape))
    mine.load_state_dict(ref.state_dict())
    x = torch.randint(0, 12, (2, 5)) if isinstance(ref, nn.Embedding) else torch.randn(2, 5, 6)
    torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=0)
    torch.manual_seed(7)
    fresh = make()[0]  # torch's reset_parameters, drawn from the global generator seeded 7
    mine.init_weights(torch.Generator().manual_seed(7))
    for (n, a), b in zip(mine.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_linear_axes_are_in_then_out_and_the_bias_has_the_output_axis():
    """Linear(d, 4d, axes=("embed", "mlp")): the stored (out, in) weight's out dim (4d) is
    the mlp dim, so tensor parallel over mlp shards it, and the bias with it."""
    m = _Wrap(fc=mnn.Linear(8, 32, axes=("embed", "mlp")))
    plans = plan_params(m, load_layout("tp"), TP)
    w, b = plans["fc.weight"], plans["fc.bias"]
    assert w.shape == (32, 8) and w.compute == (("tp",), ()) and b.compute == (("tp",),)
    plans = plan_params(m, load_layout("fsdp"), {"fsdp": 2})
    assert plans["fc.weight"].storage == ((), ("fsdp",)) and plans["fc.bias"].storage == ((),)


def test_bad_layer_axes():
    with pytest.raises(AnnotationError, match=r"Linear\(axes=\('embed',\)\): give 2 logical axes.*in_axis, out_axis"):
        mnn.Linear(4, 4, axes=("embed",))
    with pytest.raises(AnnotationError, match=r"LayerNorm\(axes=.*give 2 logical axes"):
        mnn.LayerNorm((4, 4), axes=("embed",))


# --------------------------------------------------------------------------- per-instance annotation
def test_set_axes_on_torchs_own_modules():
    m = _Wrap(emb=nn.Embedding(16, 8), head=nn.Linear(8, 16, bias=False))
    meshlm.set_axes(m.emb, weight=("vocab", "embed"))
    assert meshlm.set_axes(m.head, weight=("vocab", "embed")) is m.head
    plans = plan_params(m, load_layout("tp"), TP)
    assert plans["emb.weight"].compute == (("tp",), ()) == plans["head.weight"].compute
    assert "param_axes" not in nn.Linear.__dict__  # torch's class is untouched


def test_instance_param_axes_is_honoured_and_overrides_the_class():
    """An instance attribute param_axes is read (it used to be silently ignored), per
    instance: two instances of one class shard differently."""

    class Proj(nn.Module):
        param_axes: ClassVar[dict] = {"w": ("mlp", "embed")}

        def __init__(self, per_instance=None):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 8))
            if per_instance is not None:
                self.param_axes = {"w": per_instance}

    m = _Wrap(a=Proj(), b=Proj(("embed", "mlp")))
    plans = plan_params(m, load_layout("tp"), TP)
    assert plans["a.w"].axes == ("mlp", "embed") and plans["a.w"].compute == (("tp",), ())
    assert plans["b.w"].axes == ("embed", "mlp") and plans["b.w"].compute == ((), ("tp",))
    assert Proj.param_axes == {"w": ("mlp", "embed")}


def test_set_axes_errors_name_the_module_and_the_fix():
    lin = nn.Linear(4, 6)
    with pytest.raises(AnnotationError, match=r"Linear has no parameter 'weigth'; its own parameters are weight, bias"):
        meshlm.set_axes(lin, weigth=("mlp", "embed"))
    with pytest.raises(AnnotationError, match=r"'weight' has 2 dims \(6, 4\); give one logical axis"):
        meshlm.set_axes(lin, weight=("mlp",))


def test_unannotated_torch_module_says_how_to_annotate_it():
    m = _Wrap(blocks=nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(AnnotationError) as e:
        plan_params(m, load_layout("ddp"), {"dp": 2})
    msg = str(e.value)
    for part in (
        "`blocks.0.weight`",
        "no logical axes",
        "meshlm.nn.Linear",
        "meshlm.set_axes(model.get_submodule('blocks.0'), weight=(...))",
        "never replicates",
    ):
        assert part in msg, (part, msg)


# --------------------------------------------------------------------------- open vocabulary
class _VQ(nn.Module):
    """A model with an axis of its own: codebook entries."""

    logical_axes: ClassVar[dict] = {"codebook": "entries of the VQ codebook"}
    param_axes: ClassVar[dict] = {"codes": ("codebook", "embed")}

    def __init__(self, axes=None):
        super().__init__()
        self.codes = nn.Parameter(torch.zeros(16, 8))
        if axes is not None:
            self.param_axes = {"codes": axes}


def test_a_model_declares_its_own_axis_and_a_layout_maps_it():
    lay = parse_layout({"params": {"codebook": "tp"}, "compute": {"codebook": "tp"}}, source="vq.yaml")
    assert plan_params(_VQ(), lay, TP)["codes"].storage == (("tp",), ())
    assert plan_params(_VQ(), load_layout("fsdp"), {"fsdp": 2})["codes"].storage == ((), ("fsdp",))
    m = meshlm.declare_axes(_Wrap(p=meshlm.nn.Linear(8, 16, axes=("embed", "patch_group"))), patch_group="groups")
    lay = parse_layout({"params": {"patch_group": "tp"}}, source="pg.yaml")
    assert plan_params(m, lay, TP)["p.weight"].storage == (("tp",), ())


def test_a_typo_in_the_model_suggests_the_closest_axis():
    with pytest.raises(AxisError) as e:
        plan_params(_VQ(("codebok", "embed")), load_layout("fsdp"), {"fsdp": 2})
    msg = str(e.value)
    for part in (
        "parameter `codes`",
        "unknown logical axis 'codebok' (did you mean 'codebook'?)",
        "logical_axes = {'codebok': ",
    ):
        assert part in msg, (part, msg)
    with pytest.raises(AxisError, match=r"unknown logical axis 'embd' \(did you mean 'embed'\?\)"):
        plan_params(_VQ(("codebook", "embd")), load_layout("fsdp"), {"fsdp": 2})


def test_a_typo_in_the_layout_suggests_the_closest_axis():
    lay = parse_layout({"params": {"codebok": "tp"}}, source="layouts/vq.yaml")
    with pytest.raises(AxisError) as e:
        plan_params(_VQ(), lay, TP)
    msg = str(e.value)
    for part in (
        "layouts/vq.yaml: params.codebok",
        "'codebok' (did you mean 'codebook'?)",
        "model _VQ (it declares codebook)",
    ):
        assert part in msg, (part, msg)
    # an axis no module of this model declares is an error even when another model declares it
    lay = parse_layout({"compute": {"codebook": "tp"}}, source="vq.yaml")
    with pytest.raises(AxisError, match=r"vq.yaml: compute.codebook: .*declared by model _Wrap \(it declares none\)"):
        plan_params(_Wrap(fc=mnn.Linear(4, 4, axes=("embed", "mlp"))), lay, TP)


def test_bad_declarations():
    with pytest.raises(AxisError, match=r"'code book' is not a valid axis name"):
        plan_params(meshlm.declare_axes(_VQ(), **{"code book": "x"}), load_layout("ddp"), {"dp": 2})
    with pytest.raises(AxisError, match=r"a logical axis is a non-empty string"):
        plan_params(_VQ((3, "embed")), load_layout("ddp"), {"dp": 2})


# --------------------------------------------------------------------------- ties
class _TinyLM(nn.Module):
    """An embedding and a head, tied nanoGPT's way (the embedding takes the head's Parameter)."""

    def __init__(self, tie=True, head_axes=("embed", "vocab"), device=None, seed=0, block=False):
        super().__init__()
        self.wte = mnn.Embedding(16, 8, axes=("vocab", "embed"), init_std=0.02, device=device)
        self.mid = meshlm.block(type("Blk", (nn.Module,), {}))() if block else nn.Module()
        self.mid.lin = mnn.Linear(8, 8, axes=("embed", "mlp"), device=device)
        self.head = mnn.Linear(8, 16, bias=False, axes=head_axes, device=device)
        if tie == "torch_head":
            self.head = nn.Linear(8, 16, bias=False, device=device)
        if tie:
            self.wte.weight = self.head.weight
        if tie == "across_block":
            self.mid.lin.weight = self.wte.weight
        if device != "meta":
            meshlm.init_params(self, seed)

    def forward(self, x):
        return self.head(F.gelu(self.mid.lin(self.wte(x))))


def test_tied_parameter_is_planned_once_under_its_first_name():
    m = _TinyLM()
    assert m.head.weight is m.wte.weight
    plans = plan_params(m, load_layout("tp"), TP)
    assert set(plans) == {n for n, _ in m.named_parameters()} and "head.weight" not in plans
    assert plans["wte.weight"].compute == (("tp",), ())
    # a plain torch head, annotated by nothing, takes the embedding's axes
    assert plan_params(_TinyLM(tie="torch_head"), load_layout("tp"), TP)["wte.weight"].axes == ("vocab", "embed")


def test_tied_slots_that_disagree_on_axes():
    with pytest.raises(AnnotationError) as e:
        plan_params(_TinyLM(head_axes=("vocab", "embed")), load_layout("tp"), TP)
    msg = str(e.value)
    for part in (
        "`wte.weight` and `head.weight` are one Parameter",
        "('vocab', 'embed')",
        "('embed', 'vocab')",
        "give both the same axes",
    ):
        assert part in msg, (part, msg)


def test_a_tie_across_a_block_is_an_error_that_says_how_to_share():
    m = _TinyLM(tie="across_block", head_axes=("embed", "vocab"), block=True)
    m.mid.lin.param_axes = {"weight": ("vocab", "embed"), "bias": ("mlp",)}
    with pytest.raises(
        AnnotationError,
        match=r"tied across blocks: .*`mid.lin.weight` \(in block 'mid'\).*share the "
        r"module",
    ):
        plan_params(m, load_layout("ddp"), {"dp": 2})


def test_init_of_a_tied_model_is_its_first_slots_draw_and_the_stream_does_not_depend_on_ties():
    tied, untied = _TinyLM(seed=5), _TinyLM(tie=False, seed=5)
    torch.testing.assert_close(tied.wte.weight, untied.wte.weight, rtol=0, atol=0)
    torch.testing.assert_close(tied.mid.lin.weight, untied.mid.lin.weight, rtol=0, atol=0)
    assert not torch.equal(untied.head.weight, untied.wte.weight)
