"""NOTE [effective sharding] (meshlm/layout/effective.py): what a layout does on a mesh.

The kinds of parallelism ``effective`` reads from a layout's rules are checked against what
the lowering actually does to a real model on that mesh (``lower.plan_params`` on Llama's
parameters, ``layout.resolve`` on its activations), for every shipped layout on meshes
where its axes have size 1, are absent, or are unused."""

from __future__ import annotations

import pytest
import torch

from meshlm.core.errors import LayoutError
from meshlm.layout.effective import check, effective
from meshlm.layout.rules import load_layout, resolve, shipped_layouts

MESHES = [
    {"dp": 4},
    {"fsdp": 4},
    {"dp": 1, "fsdp": 4, "tp": 1},
    {"fsdp": 2, "tp": 2},
    {"dp": 2, "tp": 2},
    {"dp": 2, "fsdp": 2},
    {"tp": 4},
    {"dp": 1},
    {"pp": 2},
    {"fsdp": 2, "pp": 2},
    {"fsdp": 2, "tp": 2, "pp": 2},
    {"fsdp": 2, "ep": 2},
    {"tp": 2, "ep": 2},
    {"fsdp": 2, "cp": 2},
    {"fsdp": 2, "tp": 2, "cp": 2},
]


def _lowered_kinds(layout_name: str, mesh: dict) -> dict[str, set[str]]:
    """Kind -> mesh axes, read off the lowering's plans for llama_tiny, or vlm_tiny for a
    scoped layout, or moe_tiny for one that maps experts (independent of the rule scan in
    meshlm/layout/effective.py)."""
    from meshlm.models import VLM, Llama, MoETransformer, llama_config, moe_config, vlm_config
    from meshlm.runtime.lowering import plan_params

    lay = load_layout(layout_name)
    with torch.device("meta"):
        model = (
            VLM(vlm_config("vlm_tiny"), device="meta")
            if lay.scopes
            else MoETransformer(moe_config("moe_tiny"), device="meta")
            if "experts" in lay.compute
            else Llama(llama_config("llama_tiny"), device="meta")
        )
    out: dict[str, set[str]] = {}

    def add(kind, axes):
        if axes:
            out.setdefault(kind, set()).update(axes)

    def axes_of(plan) -> set[str]:
        return {m for dim in plan for m in dim}

    for pp in plan_params(model, lay, mesh).values():
        storage, compute = axes_of(pp.storage), axes_of(pp.compute)
        add("sharded params", storage - compute)
        if "experts" in pp.axes:  # the experts' dim over ep, their width over tp
            add("expert parallel", set(pp.compute[pp.axes.index("experts")]))
            add("tensor parallel", compute - set(pp.compute[pp.axes.index("experts")]))
        else:
            add("tensor parallel", compute)
        if pp.grads is not None:
            add("sharded grads", axes_of(pp.grads) - storage)
        add("sharded optimizer", axes_of(pp.optimizer) - (storage if pp.grads is None else axes_of(pp.grads)))
    from meshlm.runtime.pipeline import is_pipelined

    if is_pipelined(lay) and mesh.get("pp", 1) > 1:  # cut into stages over pp (meshlm.runtime.pipeline)
        add("pipeline parallel", {"pp"})
    for scope in [lay, *(s.layout for s in lay.scopes)]:  # activations inside each scope, and outside
        act = resolve(("batch", "seq", "embed"), scope.compute, mesh)
        add("data parallel", set(act[0]))
        add("sequence parallel", set(act[1]) - {"cp"})
        add("context parallel", set(act[1]) & {"cp"})
    return out


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("name", shipped_layouts())
def test_effective_kinds_are_what_the_lowering_does(name, mesh):
    eff = effective(load_layout(name), mesh)
    got = {k: set(v) for k, v in eff.kinds.items()}
    assert got == _lowered_kinds(name, mesh)
    live = {m for m, s in mesh.items() if s > 1}
    assert set(eff.unused) == live - {m for v in got.values() for m in v}
    # degenerate exactly when a kind the layout names on a mesh of every axis has no axis left,
    # data parallelism aside while another kind stays (one replica, split another way)
    full = {m: 2 for m in ("dp", "fsdp", "tp", "cp", "pp", "ep")}
    lost = set(_lowered_kinds(name, full)) - set(got)
    if set(got) - {"data parallel"}:
        lost.discard("data parallel")
    assert eff.degenerate == bool(lost)


def test_tp_on_a_data_mesh_says_what_ran():
    eff = effective(load_layout("tp"), {"dp": 1, "fsdp": 4, "tp": 1})
    assert eff.degenerate and eff.label() == "tp (runs as: data parallel over fsdp=4)"
    [msg] = eff.problems()
    assert "tensor parallel (tp)" in msg and "tp has size 1" in msg and "data parallel over fsdp=4" in msg
    assert not effective(load_layout("tp"), {"fsdp": 2, "tp": 2}).problems()


def test_unused_mesh_axis_is_duplicated_work():
    eff = effective(load_layout("ddp"), {"fsdp": 2, "tp": 2})
    assert not eff.degenerate and eff.unused == ["tp"]
    [msg] = eff.problems()
    assert "'tp' (size 2)" in msg and "2x duplicated work" in msg


def test_strict_raises_naming_the_key():
    with pytest.raises(LayoutError, match=r"layout.strict=true.*layout.strict=false"):
        check(load_layout("fsdp_tp"), {"fsdp": 4, "tp": 1}, strict=True)
    with pytest.raises(LayoutError, match="duplicated work"):
        check(load_layout("fsdp"), {"fsdp": 2, "tp": 2}, strict=True)
    assert check(load_layout("fsdp_tp"), {"fsdp": 4, "tp": 1}, strict=False).degenerate
    assert check(load_layout("fsdp_tp"), {"fsdp": 2, "tp": 2}, strict=True).problems() == []


def test_layout_show_prints_the_effective_sharding():
    from meshlm.app.show import layout_table

    out = layout_table("llama_tiny", "tp", "fsdp=4")
    assert "effective on this mesh: data parallel over fsdp=4" in out
    assert "warning: layout 'tp' on mesh fsdp=4: its tensor parallel (tp) drops out" in out


def test_a_pipeline_axis_no_layout_uses_is_duplicated_work():
    """``mesh.pp=2``: no shipped layout names ``pp`` (no pipeline parallelism yet), so its two
    ranks run identical copies; a warning naming the axis, an error under strict."""
    eff = check(load_layout("fsdp_tp"), {"fsdp": 2, "tp": 2, "pp": 2}, strict=False)
    assert eff.unused == ["pp"]
    [msg] = eff.problems()
    assert "'pp' (size 2)" in msg and "2x duplicated work" in msg
    with pytest.raises(LayoutError, match=r"'pp' \(size 2\).*layout.strict=true"):
        check(load_layout("fsdp_tp"), {"fsdp": 2, "tp": 2, "pp": 2}, strict=True)
    with pytest.raises(LayoutError, match=r"'tp' \(size 2\)"):
        check(load_layout("ddp"), {"dp": 1, "fsdp": 2, "tp": 2}, strict=True)


@pytest.mark.parametrize("layout,mesh", [("tp", {"tp": 2}), ("tp_sp", {"tp": 4}), ("pp", {"pp": 2})])
def test_one_replica_split_another_way_is_not_degenerate(layout, mesh):
    """The docs' own spelling, ``layout=tp mesh=tp2``: no data axis, one replica; what the
    layout is for (tensor, sequence, pipeline parallelism) stays, so there is nothing to warn of."""
    eff = effective(load_layout(layout), mesh)
    assert eff.problems() == [] and not eff.dropped, eff.problems()


def test_tp_on_a_data_mesh_still_warns():
    (msg,) = effective(load_layout("tp"), {"dp": 2}).problems()
    assert "tensor parallel (tp) drops out" in msg and "data parallel" not in msg.split("drops out")[0]
