"""``plan_model``: a :class:`Plan` for any model, from one fake training step (NOTE [fake
measurement] in measure.py): memory and collectives measured, the ZeRO formula beside the
model state."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from meshlm.core.errors import ConfigError
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.rules import is_pipelined, load_layout
from meshlm.plan.measure import Build, measure
from meshlm.plan.offload import finish, kind_entry, offload_spec_for
from meshlm.plan.report import CommEntry, Plan, _name
from meshlm.plan.state import _shard_n, _zero_formula


def plan_model(
    build: Build,
    layout,
    mesh: "Mapping[str, int] | str | MeshSpec",
    *,
    global_batch: int,
    seq: int,
    activation_checkpointing: str = "none",
    grad_accum: int = 1,
    shard_kw: "Mapping | None" = None,
    name: str = "model",
    pipeline: "Mapping | None" = None,
    offload: Any = None,
    device_is_host: bool = False,
) -> Plan:
    """Measure ``build`` under ``layout`` on ``mesh`` (:func:`meshlm.plan.measure.measure`)
    and report it as a :class:`Plan`: ``memory`` holds ``params``, ``grads``,
    ``optimizer``, ``activations`` (held from forward to backward), ``gathered`` (the
    parameter copies held with them: NOTE [parameter copies] in measure.py) and ``peak`` (the most storage alive at once in the step); ``total`` is the
    peak, the figure ``layout=auto`` compares with the limit.  A pipeline layout on a mesh
    with pp > 1 is planned per pp rank (:func:`meshlm.plan.pipeline.plan_pipeline`, with
    ``pipeline``: the ``schedule``, ``stages_per_rank`` and ``split`` of the run).
    ``offload``: the tiers (an OffloadSpec, or the run's ``offload.*`` settings over the
    layout's section; None: the layout's section), run on fake tensors as ``meshlm train``
    runs them: ``memory`` is then the device's, ``offload`` and ``tiers`` hold the rest
    (NOTE [planned offload] in meshlm/plan/offload.py)."""
    import torch

    lay = load_layout(layout)
    spec = MeshSpec.parse(mesh)
    sizes = {a: n for a, n in spec.axes if n > 1} or {"dp": 1}  # the mesh meshlm train builds
    tiers = offload_spec_for(lay, offload)
    if is_pipelined(lay) and sizes.get("pp", 1) > 1:
        if tiers.active:
            raise ConfigError(
                f"offload {tiers.label()}: meshlm plan does not plan offload under a pipeline (layout {lay.name}, "
                f"mesh {dict(sizes)}); plan it without offload (offload.optimizer=null, offload.activations=null) "
                "or plan a layout without pp"
            )
        from meshlm.plan.pipeline import plan_pipeline

        return plan_pipeline(
            build,
            lay,
            spec,
            global_batch=global_batch,
            seq=seq,
            grad_accum=grad_accum,
            activation_checkpointing=activation_checkpointing,
            shard_kw=shard_kw,
            name=name,
            **dict(pipeline or {}),
        )
    kw = dict(shard_kw or {})
    m = measure(
        build,
        lay,
        sizes,
        global_batch=global_batch,
        seq=seq,
        grad_accum=grad_accum,
        activation_checkpointing=activation_checkpointing,
        shard_kw=kw,
        offload=tiers if tiers.active else None,
        name=name,
    )
    memory = dict(m.memory, total=m.memory["peak"])
    comm = {
        (kind, axes, phase): CommEntry(kind, axes, phase, int(v["count"]), int(v["bytes"]), v["wire_bytes"], "counted")
        for (kind, axes, phase), v in m.comm.items()
    }
    sd = kw.get("param_dtype") or torch.float32
    cd = kw.get("compute_dtype") or sd
    rd = kw.get("reduce_dtype") or (torch.float32 if cd != torch.float32 or sd != torch.float32 else sd)
    B = torch.empty((), dtype=sd).element_size()
    GB = torch.empty((), dtype=kw["grad_dtype"]).element_size() if kw.get("grad_dtype") not in (None, sd) else None
    formulas = {
        "psi": m.psi,
        "flops": m.flops,
        "moe": m.moe,
        "zero": _zero_formula(lay, m.psi, _shard_n(lay, sizes), sizes.get("tp", 1), B, 4 if GB is not None else B, GB),
    }
    by = defaultdict(int)
    for c in comm.values():
        by[c.phase] += 1
    p = Plan(
        name,
        lay.name,
        sizes,
        spec.size,
        global_batch,
        seq,
        _name(sd),
        _name(torch.float32 if GB is not None else sd),
        activation_checkpointing,
        memory,
        formulas,
        list(comm.values()),
        _name(cd),
        _name(rd),
    )
    if lay.scopes:  # NOTE [planned scopes] in meshlm/plan/scopes.py
        from meshlm.plan.scopes import plan_scopes

        p.scopes = plan_scopes(build, lay, sizes, m.scopes, B)
    kinds = {k: kind_entry(getattr(tiers, k), v["bytes"], v["in_bytes"], v["out_bytes"]) for k, v in m.offload.items()}
    return finish(p, tiers, kinds, device_is_host)
