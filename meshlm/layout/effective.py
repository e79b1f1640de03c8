"""What a layout does on a given mesh: the effective sharding, and the layouts that degenerate.

NOTE [effective sharding]
    Mesh axes that a mesh lacks or that have size 1 drop out of a layout's rules (so one
    layout serves 1..N devices).  That is by design, but it can also remove the very thing
    a layout is for: ``tp`` on a mesh whose ``tp`` axis has size 1 is plain data
    parallelism, and a sweep that compares it with ``ddp`` compares ddp with itself.

    A layout is described by the *kinds* of parallelism it expresses, each over mesh axes:

        data parallel      ``compute.batch`` (the rows of the batch are split)
        sharded params     a ``params`` rule whose axis ``compute`` does not keep for that
                           logical axis (stored sharded, gathered at use: ZeRO-3 / FSDP)
        sharded grads      a ``grads`` rule whose axis ``params`` does not have (ZeRO-2)
        sharded optimizer  an ``optimizer`` rule whose axis ``grads`` does not have (ZeRO-1)
        tensor parallel    a ``compute`` rule of any other logical axis (heads, mlp, vocab ...)
        sequence parallel  ``compute.seq`` / ``compute.kv_seq`` over any axis but ``cp``
        context parallel   ``compute.seq`` / ``compute.kv_seq`` over ``cp`` (the sequence split
                           for the whole model, attention over cp: docs/cp.md)
        pipeline parallel  ``compute.layers`` (the stack of blocks cut into stages over pp,
                           NOTE [pipelined step] in meshlm/runtime/pipeline/pipe.py)
        expert parallel    ``compute.experts`` (whole experts over ep, NOTE [moe routing] in
                           meshlm/core/moe.py)

    The layout *as written* is every kind its rules name; on a mesh, the *effective* kinds
    are those left with an axis of size > 1.  The layout **degenerates** on the mesh when
    a kind it names has no axis left: then it does not do what its name says, and
    ``meshlm train`` warns (an error under ``layout.strict=true``).  Dropping some of a
    kind's axes (``batch: [dp, fsdp]`` on a mesh with ``dp`` only) is not degeneracy, nor is
    dropping data parallelism while another kind stays (``tp`` on a ``tp=2`` mesh: one
    replica, split by tensor parallelism; every layout splits the batch over whatever data
    axes the mesh has, and a mesh with none is one replica by choice).

    The other way round, a mesh axis of size > 1 that no rule of the layout names (``ddp``
    on a ``tp=2`` mesh) runs the same computation on each of its ranks: duplicated work,
    also a warning (an error under ``layout.strict=true``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshlm.core.axes import MESH_AXES
from meshlm.core.errors import LayoutError
from meshlm.layout.rules import YIELDING_AXES, Layout

KINDS = (
    "data parallel",
    "sharded params",
    "sharded grads",
    "sharded optimizer",
    "tensor parallel",
    "sequence parallel",
    "context parallel",
    "pipeline parallel",
    "expert parallel",
)


def _kinds(layout: Layout, live) -> dict[str, set[str]]:
    """Kind -> the mesh axes it uses, counting only axes for which ``live(axis)``."""
    out: dict[str, set[str]] = {k: set() for k in KINDS}
    if layout.scopes:  # the kinds of every scope's rules (NOTE [scoped layouts] in meshlm/core/scopes.py)
        for lay in [dataclasses.replace(layout, scopes=()), *(s.layout for s in layout.scopes)]:
            for k, v in _kinds(lay, live).items():
                out[k] |= v
        return {k: v for k, v in out.items() if v}

    def axes(rules, a) -> set[str]:
        return {m for m in rules.get(a, ()) if live(m)} if isinstance(rules, Mapping) else set()

    compute, params = layout.compute, layout.params
    grads, opt = layout.grad_rules, layout.optimizer_rules
    for a in compute:
        kind = (
            "data parallel"
            if a == "batch"
            else "sequence parallel"
            if a in YIELDING_AXES
            else "pipeline parallel"
            if a == "layers"
            else "expert parallel"
            if a == "experts"
            else "tensor parallel"
        )
        got = axes(compute, a)
        if kind == "sequence parallel" and "cp" in got:
            out["context parallel"].add("cp")
            got = got - {"cp"}
        out[kind] |= got
    for a in params:
        out["sharded params"] |= axes(params, a) - axes(compute, a)
    if isinstance(grads, Mapping):
        for a in grads:
            out["sharded grads"] |= axes(grads, a) - axes(params, a)
    for a in opt:
        base = grads if isinstance(grads, Mapping) else params  # ZeRO-1: grads are local until the step
        out["sharded optimizer"] |= axes(opt, a) - axes(base, a)
    return {k: v for k, v in out.items() if v}


def _rank(m: str) -> int:
    return MESH_AXES.index(m) if m in MESH_AXES else len(MESH_AXES)


def _ordered(axes) -> list[str]:
    return sorted(axes, key=_rank)


@dataclass(frozen=True)
class Effective:
    """A layout on a mesh (NOTE [effective sharding])."""

    layout: str
    mesh: dict[str, int]
    kinds: dict[str, list[str]]  # effective kind -> mesh axes of size > 1
    dropped: dict[str, list[str]] = field(default_factory=dict)  # kind the layout names -> its axes, all gone
    unused: list[str] = field(default_factory=list)  # mesh axes of size > 1 that no rule names
    sizes: dict[str, int] = field(default_factory=dict)  # every axis given, size 1 included

    @property
    def degenerate(self) -> bool:
        return bool(self.dropped)

    def summary(self) -> str:
        """One line: what runs, e.g. ``data parallel over fsdp=4`` or ``one device``."""
        if not self.kinds:
            return (
                "no parallelism (every rank computes the same)"
                if any(s > 1 for s in self.mesh.values())
                else "one device"
            )
        parts = [f"{k} over {','.join(f'{m}={self.mesh[m]}' for m in axes)}" for k, axes in self.kinds.items()]
        return "; ".join(parts)

    def label(self) -> str:
        """The layout's name, with what it runs as where that is not what it says."""
        if not self.degenerate and not self.unused:
            return self.layout
        return f"{self.layout} (runs as: {self.summary()})"

    def problems(self) -> list[str]:
        """The warnings, one sentence each, in logical terms."""
        out = []
        if self.dropped:
            gone = sorted({m for axes in self.dropped.values() for m in axes}, key=_rank)
            why = ", ".join(
                f"{m} has size {self.sizes[m]}" if m in self.sizes else f"{m} is not in the mesh" for m in gone
            )
            kinds = " and ".join(f"{k} ({'/'.join(axes)})" for k, axes in self.dropped.items())
            out.append(
                f"layout {self.layout!r} on mesh {self._mesh()}: its {kinds} drop{'s' if len(self.dropped) == 1 else ''} "
                f"out ({why}); it runs as {self.summary()}"
            )
        for m in self.unused:
            out.append(
                f"layout {self.layout!r} names no rule for mesh axis {m!r} (size {self.mesh[m]}) of mesh "
                f"{self._mesh()}: its {self.mesh[m]} ranks along {m} compute the same thing ({self.mesh[m]}x "
                "duplicated work); use a mesh without that axis, or a layout that uses it"
            )
        return out

    def _mesh(self) -> str:
        return ",".join(f"{m}={s}" for m, s in self.mesh.items()) or "dp=1 (one device)"

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "effective": self.summary(),
            "degenerate": self.degenerate,
            "dropped": self.dropped,
            "unused_mesh_axes": self.unused,
        }


def effective(layout: Layout, mesh: Mapping[str, int]) -> Effective:
    """``layout`` on a mesh of these axis sizes (NOTE [effective sharding])."""
    sizes = {m: int(s) for m, s in mesh.items()}
    named = _kinds(layout, lambda m: True)
    live = _kinds(layout, lambda m: sizes.get(m, 1) > 1)
    dropped = {k: _ordered(v) for k, v in named.items() if k not in live}
    if any(k != "data parallel" for k in live):  # one replica of a model still split: not degeneracy
        dropped.pop("data parallel", None)
    used = {m for v in live.values() for m in v}
    unused = [m for m in _ordered(sizes) if sizes[m] > 1 and m not in used]
    return Effective(
        layout.name,
        {m: s for m, s in sizes.items() if s > 1},
        {k: _ordered(v) for k, v in live.items()},
        dropped,
        unused,
        sizes,
    )


def check(layout: Layout, mesh: Mapping[str, int], strict: bool) -> Effective:
    """``effective(layout, mesh)``; under ``strict`` (``layout.strict=true``) a layout that
    degenerates on the mesh or leaves a mesh axis unused raises a :class:`LayoutError`."""
    eff = effective(layout, mesh)
    if strict and eff.problems():
        raise LayoutError(
            "; ".join(eff.problems()) + ". layout.strict=true makes this an error: pick a mesh on "
            "which every kind of parallelism the layout names has an axis of size > 1, or set "
            "layout.strict=false to run it as it is"
        )
    return eff
