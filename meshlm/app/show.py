"""``meshlm layout show``: where every parameter of a model lives under a layout and mesh.

Pure planning: the model (any ``model`` node, NOTE [model node] in meshlm/models/node.py)
is built on the meta device and nothing is communicated, so any
mesh size works in one process (no process group is needed to place parameters).
"""

from __future__ import annotations

import torch

from meshlm.app.model_build import build_model
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.rules import load_layout
from meshlm.models.node import ModelConfig
from meshlm.runtime.lowering import plan_params


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _placement_str(plan, names: tuple[str, ...]) -> str:
    """DTensor-style placements per mesh axis, e.g. ``fsdp:S(2) tp:S(0)``."""
    parts = []
    for n in names:
        d = next((i for i, axes in enumerate(plan) if n in axes), None)
        parts.append(f"{n}:{'R' if d is None else f'S({d})'}")
    return " ".join(parts) or "R"


def model_node(model: "str | ModelConfig") -> ModelConfig:
    """A model node: as given, or the shipped ``conf/model/<name>.yaml``."""
    if isinstance(model, ModelConfig):
        return model
    from meshlm.app.config import load_config

    return load_config([f"model={model}"]).model


def layout_rows(model: "str | ModelConfig", layout: str, mesh: str) -> tuple[list[dict], MeshSpec]:
    """One dict per parameter of ``model`` (a model node, or the name of a shipped one):
    fqn, axes, storage/compute/grads/optimizer placements, global and local shapes, bytes
    per rank."""
    spec = MeshSpec.parse(mesh)
    lay = load_layout(layout)
    m = build_model(model_node(model), "meta")
    plans = plan_params(m, lay, spec)
    sizes = spec.as_dict()
    names = tuple(a for a, s in spec.active())
    stage = _stages(model, lay, spec)
    rows = []
    for fqn, pp in plans.items():
        local = pp.local_shape(pp.storage, sizes)
        numel = 1
        for n in local:
            numel *= n
        rows.append(
            {
                "fqn": fqn,
                "axes": "(" + ", ".join(a or "-" for a in pp.axes) + ")",
                "storage": _placement_str(pp.storage, names),
                "compute": _placement_str(pp.compute, names),
                "grads": "local" if pp.grads is None else _placement_str(pp.grads, names),
                "optimizer": _placement_str(pp.optimizer, names),
                "global": "x".join(map(str, pp.shape)),
                "local": "x".join(map(str, local)),
                "bytes": numel * torch.empty((), dtype=pp.dtype, device="meta").element_size(),
                "scope": _scope_label(lay, fqn),
            }
        )
        if stage:  # a pipeline: which pp rank holds it, in place of "replicated over pp"
            for k in ("storage", "compute", "grads", "optimizer"):
                rows[-1][k] = rows[-1][k].replace("pp:R", f"pp:rank {stage[fqn]}")
            rows[-1]["pp_rank"] = stage[fqn]
    return rows, spec


def _scope_label(lay, fqn: str) -> str:
    """``path (layout)`` of the scope holding ``fqn``, or ``-`` (NOTE [scoped layouts])."""
    from meshlm.core.scopes import scope_of

    sc = scope_of(lay, fqn)
    return "-" if sc is None else f"{sc.path} ({sc.layout.name})"


def _stages(model, lay, spec: MeshSpec) -> dict[str, int]:
    """Parameter FQN -> the pp rank that holds it, for a pipeline layout on a mesh with
    pp > 1 (the balanced cut, one stage per rank: meshlm train's default); else {}."""
    from meshlm.layout.rules import is_pipelined
    from meshlm.runtime.pipeline import cut, probe

    pp = spec.as_dict().get("pp", 1)
    if not is_pipelined(lay) or pp < 2:
        return {}
    tok = torch.zeros(1, 8, dtype=torch.long)
    c = cut(probe(build_model(model_node(model), "meta"), (tok, tok)), pp, pp)
    return {fqn: c.ranks[s] for s, names in enumerate(c.params) for fqn in names}


def layout_table(model: "str | ModelConfig", layout: str, mesh: str) -> str:
    """The table ``meshlm layout show`` prints."""
    model = model_node(model)
    rows, spec = layout_rows(model, layout, mesh)
    lay = load_layout(layout)
    cols = ["fqn", "axes", "storage", "compute", "global", "local", "bytes/rank"]
    show_go = any(r["grads"] != r["storage"] or r["optimizer"] != r["storage"] for r in rows)
    if show_go:
        cols[4:4] = ["grads", "optimizer"]
    if lay.scopes:
        cols.insert(1, "scope")
    table = [
        [r["fqn"]]
        + ([r["scope"]] if lay.scopes else [])
        + [r["axes"], r["storage"], r["compute"]]
        + ([r["grads"], r["optimizer"]] if show_go else [])
        + [r["global"], r["local"], _fmt_bytes(r["bytes"])]
        for r in rows
    ]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    total = sum(r["bytes"] for r in rows)
    from meshlm.layout.effective import effective

    eff = effective(lay, spec.as_dict())
    out = [
        f"layout {lay.name} ({lay.source}) on mesh {spec} ({spec.size} devices), model {model.label}",
        f"effective on this mesh: {eff.summary()}",
    ]
    out += [f"warning: {w}" for w in eff.problems()]
    out += [
        "placements per mesh axis: S(d) = sharded on tensor dim d, R = replicated",
        "",
        line(cols),
        line(["-" * w for w in widths]),
    ]
    out += [line(t) for t in table]
    if any("pp_rank" in r for r in rows):
        by = {}
        for r in rows:
            by[r["pp_rank"]] = by.get(r["pp_rank"], 0) + r["bytes"]
        each = ", ".join(f"pp rank {k}: {_fmt_bytes(v)}" for k, v in sorted(by.items()))
        out += ["", f"{len(rows)} parameters; parameters per rank (storage): {each} (stages balanced by size)"]
    else:
        out += ["", f"{len(rows)} parameters, {_fmt_bytes(total)} of parameters per rank (storage)"]
    if lay.scopes:
        by_scope: dict[str, int] = {}
        for r in rows:
            by_scope[r["scope"]] = by_scope.get(r["scope"], 0) + r["bytes"]
        out.append(
            "per scope: " + ", ".join(f"{k if k != '-' else 'top level'}: {_fmt_bytes(v)}" for k, v in by_scope.items())
        )
    return "\n".join(out)
