"""``plan_model``: a :class:`Plan` for any model, from one fake training step (NOTE [fake
measurement] in measure.py): memory and collectives measured, the ZeRO formula beside the
model state."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from meshlm.layout import is_pipelined, load_layout
from meshlm.mesh import MeshSpec
from meshlm.plan.measure import Build, measure
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
) -> Plan:
    """Measure ``build`` under ``layout`` on ``mesh`` (:func:`meshlm.plan.measure.measure`)
    and report it as a :class:`Plan`: ``memory`` holds ``params``, ``grads``,
    ``optimizer``, ``activations`` (held from forward to backward, at-use parameter copies
    included) and ``peak`` (the most storage alive at once in the step); ``total`` is the
    peak, the figure ``layout=auto`` compares with the limit.  A pipeline layout on a mesh
    with pp > 1 is planned per pp rank (:func:`meshlm.plan.pipeline.plan_pipeline`, with
    ``pipeline``: the ``schedule``, ``stages_per_rank`` and ``split`` of the run)."""
    import torch

    lay = load_layout(layout)
    spec = MeshSpec.parse(mesh)
    sizes = {a: n for a, n in spec.axes if n > 1} or {"dp": 1}  # the mesh meshlm train builds
    if is_pipelined(lay) and sizes.get("pp", 1) > 1:
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
    )
    memory = dict(m.memory, total=m.memory["peak"])
    comm: dict[tuple, CommEntry] = {}
    for r in m.comm.records:
        e = comm.setdefault((r.kind, r.axes, r.phase), CommEntry(r.kind, r.axes, r.phase, 0, 0, 0.0, "counted"))
        e.count += 1
        e.bytes += r.bytes
        e.wire_bytes += r.wire_bytes
    sd = kw.get("param_dtype") or torch.float32
    cd = kw.get("compute_dtype") or sd
    rd = kw.get("reduce_dtype") or (torch.float32 if cd != torch.float32 or sd != torch.float32 else sd)
    B = torch.empty((), dtype=sd).element_size()
    GB = torch.empty((), dtype=kw["grad_dtype"]).element_size() if kw.get("grad_dtype") not in (None, sd) else None
    formulas = {
        "psi": m.psi,
        "flops": m.flops,
        "zero": _zero_formula(lay, m.psi, _shard_n(lay, sizes), sizes.get("tp", 1), B, 4 if GB is not None else B, GB),
    }
    by = defaultdict(int)
    for c in comm.values():
        by[c.phase] += 1
    return Plan(
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
