"""The resolver as tables, the YAML schema, and every layout error in logical terms."""

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import meshlm
from meshlm.core.errors import AnnotationError, AxisError, LayoutError, MeshError
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.rules import is_pipelined, layout_axes, load_layout, parse_layout, resolve, shipped_layouts
from meshlm.models import CONFIGS, Llama, llama_config
from meshlm.runtime.lowering import plan_params

SHIPPED = Path(__file__).resolve().parents[2] / "layouts"

FSDP_TP = parse_layout(
    {
        "params": {"embed": "fsdp", "heads": "tp", "mlp": "tp", "vocab": "tp"},
        "compute": {"batch": ["dp", "fsdp"], "seq": "tp", "heads": "tp", "mlp": "tp", "vocab": "tp"},
    },
    name="t",
    source="t.yaml",
)

# (axes, section, mesh, expected per-dim mesh axes)
RESOLVE_TABLE = [
    # storage of an MLP weight: mlp over tp, embed over fsdp
    (("mlp", "embed"), "params", {"fsdp": 2, "tp": 2}, (("tp",), ("fsdp",))),
    # compute drops fsdp (gather at use) but keeps tp
    (("mlp", "embed"), "compute", {"fsdp": 2, "tp": 2}, (("tp",), ())),
    # a list shards one dim over several mesh axes, outer -> inner
    (("batch", "seq", "embed"), "compute", {"dp": 2, "fsdp": 2}, (("dp", "fsdp"), (), ())),
    # absent mesh axes drop out
    (("batch", "seq", "embed"), "compute", {"fsdp": 4}, (("fsdp",), (), ())),
    # size-1 mesh axes drop out
    (("batch", "seq", "embed"), "compute", {"dp": 1, "fsdp": 1, "tp": 1}, ((), (), ())),
    # sequence parallel between blocks: seq over tp
    (("batch", "seq", "embed"), "compute", {"fsdp": 2, "tp": 2}, (("fsdp",), ("tp",), ())),
    # NOTE [sequence yields]: inside attention heads take tp and seq is gathered
    (("batch", "heads", "seq", "head_dim"), "compute", {"fsdp": 2, "tp": 2}, (("fsdp",), ("tp",), (), ())),
    (("batch", "seq", "vocab"), "compute", {"tp": 4}, ((), (), ("tp",))),
    # None is never sharded
    (("batch", None, "embed"), "compute", {"fsdp": 2, "tp": 2}, (("fsdp",), (), ())),
    # unmapped logical axes are replicated
    (("head_dim",), "params", {"fsdp": 2, "tp": 2}, ((),)),
]


@pytest.mark.parametrize("axes,section,mesh,expected", RESOLVE_TABLE)
def test_resolve_table(axes, section, mesh, expected):
    assert resolve(axes, FSDP_TP.rules(section), mesh) == expected


def test_rules_of_each_section():
    lay = parse_layout(
        {
            "params": {"embed": "fsdp"},
            "compute": {"batch": "dp"},
            "grads": {"embed": "dp"},
            "optimizer": {"embed": ["dp", "fsdp"]},
        }
    )
    assert [lay.rules(s) for s in ("params", "compute", "grads", "optimizer")] == [
        {"embed": ("fsdp",)},
        {"batch": ("dp",)},
        {"embed": ("dp",)},
        {"embed": ("dp", "fsdp")},
    ]
    local = parse_layout({"params": {"embed": "fsdp"}, "grads": "local"})  # the optimizer defaults to params
    assert local.rules("grads") == "local" and local.rules("optimizer") == {"embed": ("fsdp",)}


def test_axes_a_layout_maps_and_the_mesh_axes_it_uses():
    """``layout_axes``: every logical axis of every section (a ``grads: local`` section maps
    none); ``mesh_axes_used``: every mesh axis of every section, the grads' included."""
    lay = parse_layout(
        {
            "params": {"gizmo": "fsdp"},
            "compute": {"batch": "dp"},
            "grads": {"embed": ["dp", "tp"]},
            "optimizer": {"mlp": "cp"},
        }
    )
    assert layout_axes(lay) == {"gizmo", "batch", "embed", "mlp"}
    assert lay.mesh_axes_used() == {"fsdp", "dp", "tp", "cp"}
    local = parse_layout({"params": {"gizmo": "fsdp"}, "compute": {"batch": "dp"}, "grads": "local"})
    assert layout_axes(local) == {"gizmo", "batch"}
    assert local.mesh_axes_used() == {"fsdp", "dp"}
    # a model's own axis that only storage maps is known under compute (replicated there)
    assert resolve(("gizmo", "batch"), lay.rules("compute"), {"fsdp": 2, "dp": 2}, layout=lay) == ((), ("dp",))
    # ``known`` given (the model's vocabulary) is the vocabulary, whatever the layout maps
    assert resolve(("router",), lay.rules("compute"), {"dp": 2}, layout=lay, known={"router"}) == ((),)
    with pytest.raises(AxisError, match="unknown logical axis 'gizmo'"):
        resolve(("gizmo",), lay.rules("compute"), {"dp": 2}, layout=lay, known={"router"})


def test_which_layouts_are_pipelined():
    """``layers: pp`` in storage or in compute cuts stages; no other mapping does."""
    assert {n for n in shipped_layouts() if is_pipelined(load_layout(n))} == {
        "pp",
        "fsdp_pp",
        "fsdp_tp_pp",
        "fsdp_ep_pp",
        "fsdp_cp_pp",
    }
    assert is_pipelined(parse_layout({"params": {"layers": "pp"}}))
    assert is_pipelined(parse_layout({"compute": {"layers": ["fsdp", "pp"]}}))
    assert not is_pipelined(parse_layout({"params": {"layers": "fsdp"}, "compute": {"embed": "pp"}}))


def test_shipped_layouts_all_present_and_documented():
    names = set(shipped_layouts())
    want = {"single", "ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp"}
    assert want <= names
    for n in want:
        lay = load_layout(n)
        assert len(lay.description) > 80, f"layouts/{n}.yaml needs a header comment saying when to use it"


def test_zero_layout_sections():
    z1, z2 = load_layout("zero1"), load_layout("zero2")
    assert z1.grads == "local" and z1.optimizer_rules["embed"] == ("dp", "fsdp") and z1.params == {}
    assert z2.grad_rules["embed"] == ("dp", "fsdp") and z2.optimizer_rules == z2.grad_rules and z2.params == {}


def test_unknown_logical_axis_in_yaml(tmp_path):
    """Logical axes are an open vocabulary (NOTE [open vocabulary] in meshlm/core/axes.py), so a
    layout alone cannot tell a typo from a model's own axis: the typo is caught when the
    layout meets a model, naming the file, the key and the closest known axis."""
    p = tmp_path / "bad.yaml"
    p.write_text("params:\n  embd: fsdp\n")
    lay = load_layout(str(p))
    with pytest.raises(AxisError, match=r"bad.yaml: params.embd: .*logical axis 'embd' \(did you mean 'embed'\?\)"):
        plan_params(Llama(llama_config("llama_tiny"), device="meta"), lay, {"fsdp": 2})


def test_a_layout_by_path_or_by_name(tmp_path, monkeypatch):
    """A string ending in .yaml or .yml, or holding a path separator, is a file when it
    exists (relative to the working directory too); anything else is a name looked up in
    ``layout_dirs()``, even where a file of that name is in the working directory; and a
    path that does not exist says so, where an unknown name lists the shipped ones."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("params:\n  embed: fsdp\n")
    (tmp_path / "mine.yml").write_text("params:\n  embed: tp\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "plain").write_text("params:\n  mlp: tp\n")
    (tmp_path / "fsdp").write_text("params:\n  mlp: cp\n")  # not a layout file: a name is looked up
    assert load_layout("mine.yaml").params == {"embed": ("fsdp",)}
    assert load_layout("mine.yml").params == {"embed": ("tp",)}
    assert load_layout(f"sub{os.sep}plain").params == {"mlp": ("tp",)}
    assert load_layout("fsdp").source == str(SHIPPED / "fsdp.yaml")
    for missing in ("nope.yaml", "nope.yml", f"sub{os.sep}nope", str(tmp_path / "nope.yaml")):
        with pytest.raises(LayoutError, match=f"^layout file {re.escape(missing)} does not exist$"):
            load_layout(missing)
    with pytest.raises(LayoutError, match="^unknown layout 'nope'. Shipped layouts: "):
        load_layout("nope")


def test_an_empty_layout_file_is_an_error(tmp_path):
    """An empty file (or one of comments only, or one caught while another process rewrites
    it) is refused, not read as a layout that keeps every tensor whole: benchmarks/cp_bench.py
    once had ranks read a layout file another rank had just truncated, and they ran different
    attention variants until gloo timed out.  ``params: {}`` says "whole" on purpose."""
    for text in ("", "# only a comment\n"):
        p = tmp_path / "empty.yaml"
        p.write_text(text)
        with pytest.raises(
            LayoutError, match=rf"^layout file {re.escape(str(p))} is empty \(no sections\);.*params: \{{\}}"
        ):
            load_layout(str(p))
    p.write_text("params: {}\n")
    assert (load_layout(str(p)).params, load_layout(str(p)).compute) == ({}, {})


def test_unknown_mesh_axis_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("compute:\n  batch: [dp, fdsp]\n")
    with pytest.raises(AxisError, match=r"compute.batch: unknown mesh axis 'fdsp'"):
        load_layout(str(p))


def test_malformed_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("params: {embed: fsdp\n")
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    with pytest.raises(yaml.YAMLError) as y:
        yaml.safe_load(p.read_text())
    assert "\n" in str(y.value)  # yaml's own message spans lines; the error is one line
    assert str(e.value) == f"layout file {p} is not valid YAML: {y.value}".replace("\n", " ")
    p.write_text("- embed\n")
    with pytest.raises(LayoutError, match="a layout is a mapping"):
        load_layout(str(p))
    p.write_text("parms: {}\n")
    with pytest.raises(LayoutError, match=r"unknown section\(s\) \['parms'\]"):
        load_layout(str(p))
    p.write_text("params: {embed: 3}\n")
    with pytest.raises(LayoutError, match="expected a mesh axis"):
        load_layout(str(p))


SECTIONS_TEXT = "params, compute, grads, optimizer"
# (the dict given to parse_layout(..., source="s.yaml"), the error's class, its whole text)
PARSE_ERRORS = [
    (["embed"], LayoutError, f"s.yaml: a layout is a mapping with sections {SECTIONS_TEXT}; got list"),
    (
        {"parms": {}},
        LayoutError,
        f"s.yaml: unknown section(s) ['parms']; a layout has the sections {SECTIONS_TEXT} "
        "(params and compute are the usual two), scopes, offload and context",
    ),
    (
        {"offload": {"optimzer": "disk"}},
        LayoutError,
        "s.yaml: offload.optimzer: not a kind of state; offload takes optimizer, grads, params, activations, dir",
    ),
    (
        {"offload": {"optimizer": "nvme"}},
        LayoutError,
        "s.yaml: offload.optimizer='nvme' is not a tier; choose one of: device, host, disk",
    ),
    (
        {"offload": "disk"},
        LayoutError,
        "s.yaml: offload: an offload section maps kinds of state (optimizer, grads, params, activations) to a "
        "tier; got 'disk'",
    ),
    ({"params": "fsdp"}, LayoutError, "s.yaml: section 'params' must map logical axes to mesh axes; got 'fsdp'"),
    (
        {"grads": "locl"},
        LayoutError,
        "s.yaml: section 'grads' must map logical axes to mesh axes (or the string 'local'); got 'locl'",
    ),
    (
        {"params": {"em bed": "fsdp"}},
        AxisError,
        "s.yaml: params.em bed: 'em bed' is not a logical axis name (an identifier such as 'embed')",
    ),
    ({"params": {"embed": 3}}, LayoutError, "s.yaml: params.embed: expected a mesh axis or a list of mesh axes, got 3"),
    (
        {"compute": {"embed": ["fsdp", 2]}},
        LayoutError,
        "s.yaml: compute.embed: expected a mesh axis or a list of mesh axes, got ['fsdp', 2]",
    ),
    (
        {"optimizer": {"embed": "fdsp"}},
        AxisError,
        "s.yaml: optimizer.embed: unknown mesh axis 'fdsp'. Mesh axes are dp, fsdp, tp, cp, pp, ep (outer -> inner).",
    ),
    (
        {"params": {"embed": ["fsdp", "fsdp"]}},
        LayoutError,
        "s.yaml: params.embed: mesh axis listed twice in ['fsdp', 'fsdp']",
    ),
    (
        {"params": {"embed": ["tp", "fsdp"]}},
        LayoutError,
        "s.yaml: params.embed: mesh axes ['tp', 'fsdp'] are not in canonical outer -> inner order; "
        "write ['fsdp', 'tp'] (see NOTE [shard order] in meshlm/layout/rules.py)",
    ),
]


@pytest.mark.parametrize("data,cls,text", PARSE_ERRORS)
def test_parse_layout_errors_in_full(data, cls, text):
    with pytest.raises(cls) as e:
        parse_layout(data, source="s.yaml")
    assert str(e.value) == text


def test_parse_layout_defaults_and_value_forms():
    """Missing grads and optimizer sections are "as params" (None), missing params and
    compute are empty; a mesh axis, a list, and nothing (null or []) are the value forms."""
    empty = parse_layout(None)
    assert (empty.name, empty.source, empty.description) == ("<dict>", "<dict>", "")
    assert (empty.params, empty.compute, empty.grads, empty.optimizer) == ({}, {}, None, None)
    lay = parse_layout({"params": {"embed": "fsdp", "mlp": ["fsdp", "tp"], "heads": None, "vocab": []}})
    assert lay.params == {"embed": ("fsdp",), "mlp": ("fsdp", "tp"), "heads": (), "vocab": ()}
    assert lay.grads is None and lay.optimizer is None
    assert lay.grad_rules == lay.params and lay.optimizer_rules == lay.params
    with pytest.raises(LayoutError, match="^<dict>: unknown section"):
        parse_layout({"param": {}})


def test_resolve_allow_mesh_and_two_yielding_dims():
    """``allow_mesh`` keeps only the mesh axes it names; two sequence dims on one mesh axis
    do not yield to each other (NOTE [sequence yields]): the axis is used twice."""
    rules, mesh = {"embed": ("fsdp", "tp"), "seq": ("tp",), "kv_seq": ("tp",)}, {"fsdp": 2, "tp": 2}
    assert resolve(("embed",), rules, mesh, allow_mesh=("tp",)) == (("tp",),)
    assert resolve(("embed",), rules, mesh, allow_mesh=()) == ((),)
    assert resolve(("embed",), rules, mesh) == (("fsdp", "tp"),)
    with pytest.raises(
        LayoutError, match=r"^tensor: mesh axis 'tp' is used twice, by dim 0 \(seq\) and dim 1 \(kv_seq\)"
    ):
        resolve(("seq", "kv_seq"), rules, mesh)


def test_resolve_errors_with_the_default_labels():
    """A caller that names neither the tensor, the section nor the layout gets "tensor",
    "compute" and "layout" in the error, and the whole fix."""
    rules, mesh = {"embed": ("fsdp",), "mlp": ("fsdp",)}, {"fsdp": 2}
    with pytest.raises(LayoutError) as e:
        resolve(("mlp", "embed"), rules, mesh)
    assert str(e.value) == (
        "tensor: mesh axis 'fsdp' is used twice, by dim 0 (mlp) and dim 1 (embed), under layout: compute.mlp "
        "and compute.embed. A mesh axis can shard one dim of a tensor only: map one of these logical axes to "
        "another mesh axis or to nothing."
    )
    with pytest.raises(LayoutError) as e:
        resolve(("embed",), rules, mesh, shape=(3,))
    assert str(e.value) == (
        "tensor axis 'embed' (size 3) is not divisible by mesh axis fsdp (size 2) in layout: compute.embed. Use a "
        "mesh whose fsdp size divides 3, or map 'embed' to another mesh axis (or to nothing) in that layout."
    )
    with pytest.raises(LayoutError) as e:  # over two mesh axes: 4 rows of 6 do not divide
        resolve(("batch",), {"batch": ("dp", "fsdp")}, {"dp": 2, "fsdp": 2}, shape=(6,))
    assert str(e.value) == (
        "tensor axis 'batch' (size 6) is not divisible by mesh axis dp (size 2) x fsdp (size 2) in layout: "
        "compute.batch. Use a mesh whose dp/fsdp size divides 6, or map 'batch' to another mesh axis (or to "
        "nothing) in that layout."
    )
    with pytest.raises(LayoutError) as e:
        resolve(("embed",), rules, mesh, shape=(4, 2))
    assert str(e.value) == "tensor: 1 logical axes ('embed',) for a tensor of 2 dims (4, 2)"
    with pytest.raises(AxisError, match=r"^tensor: unknown logical axis 'embd' \(did you mean 'embed'\?\)"):
        resolve(("embd",), rules, mesh)


def test_non_canonical_list_order(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("compute:\n  batch: [fsdp, dp]\n")
    with pytest.raises(LayoutError, match=r"write \['dp', 'fsdp'\]"):
        load_layout(str(p))


def test_unknown_layout_name_lists_shipped():
    with pytest.raises(LayoutError) as e:
        load_layout("fsdp_pt")
    names = shipped_layouts()
    assert "fsdp_tp" in names
    assert str(e.value) == (
        f"unknown layout 'fsdp_pt'. Shipped layouts: {', '.join(names)}. "
        "Pass one of those names or a path to a YAML file."
    )


def test_a_layout_files_header_comment_is_its_description(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("# mine: two lines\n#of description\nparams: {}  # not this\n#\n")
    lay = load_layout(str(p))
    assert lay.description == "mine: two lines\nof description"
    assert (lay.name, lay.source) == ("mine", str(p))


def test_mesh_axis_used_twice_in_one_tensor():
    lay = parse_layout({"params": {"mlp": "tp", "embed": "tp"}}, source="layouts/x.yaml")
    m = Llama(llama_config("llama_tiny"), device="meta")
    with pytest.raises(
        LayoutError, match=r"param `layers.0.mlp.w_gate`: mesh axis 'tp' is used twice.*params.mlp and params.embed"
    ):
        plan_params(m, lay, {"tp": 2})


def test_indivisible_dim_names_param_size_axis_and_layout_key():
    # 6 kv heads over tp=4
    m = Llama(llama_config("llama_tiny", heads=12, kv_heads=6, embed=96), device="meta")
    with pytest.raises(LayoutError) as e:
        plan_params(m, load_layout("tp"), {"tp": 4})
    msg = str(e.value)
    for part in ("layers.0.attn.wk", "'kv_heads' (size 6)", "mesh axis tp (size 4)", "tp.yaml: params.kv_heads"):
        assert part in msg, (part, msg)


class _Unannotated(nn.Module):
    param_axes = {"w": ("embed", "mlp")}

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 8))
        self.bias = nn.Parameter(torch.zeros(8))


def test_unannotated_parameter_is_an_error_not_replicated():
    with pytest.raises(AnnotationError, match=r"parameter `bias` .*_Unannotated.param_axes has no entry 'bias'"):
        plan_params(_Unannotated(), load_layout("ddp"), {"dp": 2})


def test_wrong_number_of_axes():
    class M(nn.Module):
        param_axes = {"w": ("embed",)}

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 8))

    with pytest.raises(AnnotationError, match="has 2 dims"):
        plan_params(M(), load_layout("ddp"), {"dp": 2})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_parameter_of_every_model_is_annotated(name):
    m = Llama(llama_config(name), device="meta")
    plans = plan_params(m, load_layout("single"), {"dp": 1})
    assert set(plans) == {n for n, _ in m.named_parameters()}
    for fqn, p in plans.items():
        assert len(p.axes) == len(p.shape) and all(a is not None for a in p.axes), fqn


def test_mesh_spec_parse():
    assert MeshSpec.parse("tp=2,fsdp=2").axes == (("fsdp", 2), ("tp", 2))  # canonical order
    assert MeshSpec.parse({"dp": -1, "tp": 2}, world_size=8).as_dict() == {"dp": 4, "tp": 2}
    assert MeshSpec.parse({"dp": 1, "fsdp": 4, "tp": 1}).active() == (("fsdp", 4),)
    with pytest.raises(MeshError, match="at most one axis may be -1"):
        MeshSpec.parse({"dp": -1, "tp": -1}, world_size=8)
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        MeshSpec.parse({"dp": -1, "tp": 4}, world_size=6)
    with pytest.raises(AxisError, match="unknown mesh axis 'xp'"):
        MeshSpec.parse("xp=2")


def test_make_mesh_outside_launch_says_how_to_fix():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(MeshError, match="needs 4 processes.*torchrun --nproc-per-node 4"):
        meshlm.make_mesh({"fsdp": 2, "tp": 2})


def test_model_runs_unchanged_without_shard():
    """Annotations are data: with no lowering, constrain is the identity and the model is
    plain PyTorch."""
    cfg = llama_config("llama_tiny")
    m = Llama(cfg, seed=0)
    toks = torch.randint(0, cfg.vocab, (2, 8))
    logits = m(toks)
    assert logits.shape == (2, 8, cfg.vocab) and type(logits) is torch.Tensor
    loss = m(toks, toks)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    # the same seed gives the same weights; init_params replays the same order
    m2 = Llama(cfg, device="meta")
    m2 = m2.to_empty(device="cpu")
    meshlm.init_params(m2, 0)
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n


def test_layout_show_cli_table(capsys):
    from meshlm.app.cli import main

    assert main(["layout", "show", "fsdp_tp", "--model", "llama3_8b", "--mesh", "dp=8,fsdp=16,tp=8"]) == 0
    out = capsys.readouterr().out
    assert "on mesh dp=8,fsdp=16,tp=8 (1024 devices)" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("layers.0.attn.wq "))
    # heads over tp (dim 0), embed over fsdp (dim 2); 32x128x4096 -> 4x128x256 fp32 per rank
    assert "dp:R fsdp:S(2) tp:S(0)" in row and "32x128x4096" in row and "4x128x256" in row and "512.00 KiB" in row
    assert main(["layout", "show", "tp", "--model", "llama_tiny", "--mesh", "tp=3"]) == 1
    assert "not divisible by mesh axis tp (size 3)" in capsys.readouterr().err
