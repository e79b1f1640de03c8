"""Planning: where every parameter lives, per tensor dim, and the placements that says.

The only place that turns logical axes into DTensor Placements (``placements``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshlm.core import ties
from meshlm.core.axes import DATA_AXES, Axes, check_layout_keys, vocabulary
from meshlm.core.errors import LayoutError
from meshlm.core.scopes import check_scopes
from meshlm.layout.mesh import MeshSpec, mesh_spec
from meshlm.layout.rules import DimPlan, Layout, resolve


@dataclass(frozen=True)
class ParamPlan:
    """Where one parameter lives, per tensor dim: the mesh axes it is sharded over."""

    fqn: str
    axes: Axes
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage: DimPlan
    compute: DimPlan
    grads: Optional[DimPlan]  # None: local, unreduced until the optimizer step (ZeRO-1)
    optimizer: DimPlan

    def local_shape(self, plan: DimPlan, sizes: Mapping[str, int]) -> tuple[int, ...]:
        out = []
        for n, axes in zip(self.shape, plan):
            k = 1
            for a in axes:
                k *= sizes.get(a, 1)
            out.append(n // k)
        return tuple(out)


def iter_params(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Tensor]]:
    """(fqn, owning module, attribute name, parameter) for every parameter, once each."""
    seen: set[int] = set()
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mname}.{pname}" if mname else pname), m, pname, p


def plan_params(
    model: nn.Module, layout: Layout, mesh: "Mapping[str, int] | MeshSpec | DeviceMesh"
) -> dict[str, ParamPlan]:
    """Plan every parameter of ``model`` under ``layout`` on a mesh of the given sizes.

    Raises :class:`AnnotationError` for a parameter without logical axes (never silently
    replicated), :class:`AxisError` for a logical axis, in the model or the layout, that
    is neither standard nor declared by the model (NOTE [open vocabulary] in axes.py), and
    :class:`LayoutError` for axes that do not fit the mesh.  A tied parameter (one
    Parameter in several modules) is planned once, under its first FQN (NOTE [ties]).
    """
    sizes = mesh_sizes(mesh)
    known = vocabulary(model)
    for lay in layout.all_layouts():
        check_layout_keys(lay, known, type(model).__name__)
    slots = ties.slots(model)
    ties.aliases(model)  # a tie meshlm cannot lower is an error here already
    params = [(fqn, p, ties.param_axes(slots[id(p)], p, known)) for fqn, _m, _n, p in iter_params(model)]
    check_scopes(model, layout, {fqn: axes for fqn, _p, axes in params})
    out: dict[str, ParamPlan] = {}
    for fqn, p, axes in params:
        lay = layout.for_path(fqn)  # NOTE [scoped layouts] in meshlm/core/scopes.py
        what = f"param `{fqn}`"
        shape = tuple(p.shape)
        kw = dict(shape=shape, what=what, layout=lay, known=known)
        storage = resolve(axes, lay.params, sizes, section="params", **kw)
        compute = resolve(axes, lay.compute, sizes, section="compute", **kw)
        g = lay.grad_rules
        grads = None if g == "local" else resolve(axes, g, sizes, section="grads" if lay.grads else "params", **kw)  # type: ignore[arg-type]
        opt_sec = "optimizer" if lay.optimizer is not None else ("grads" if isinstance(lay.grads, dict) else "params")
        optim = resolve(axes, lay.optimizer_rules, sizes, section=opt_sec, **kw)
        out[fqn] = ParamPlan(fqn, axes, shape, p.dtype, storage, compute, grads, optim)
    return out


def mesh_sizes(mesh: "Mapping[str, int] | MeshSpec | DeviceMesh") -> dict[str, int]:
    """Mesh axis name -> size."""
    if isinstance(mesh, DeviceMesh):
        return mesh_spec(mesh).as_dict()
    if isinstance(mesh, MeshSpec):
        return mesh.as_dict()
    return dict(mesh)


def placements(plan: DimPlan, mesh: "DeviceMesh | tuple[str, ...]") -> tuple[Placement, ...]:
    """DTensor placements (one per mesh dim) for a per-tensor-dim plan.

    NOTE [shard order] in meshlm/layout/rules.py: several mesh axes on one dim are listed outer -> inner in mesh
    order, which is DTensor's default order for repeated Shard(d), so no strided shards."""
    names = mesh if isinstance(mesh, tuple) else tuple(mesh.mesh_dim_names or ())
    out: list[Placement] = []
    for n in names:
        d = next((i for i, axes in enumerate(plan) if n in axes), None)
        out.append(Replicate() if d is None else Shard(d))
    return tuple(out)


def local_box(shape: Sequence[int], mesh: DeviceMesh, pl: Sequence[Placement]) -> list[tuple[int, int]]:
    """(start, length) per dim of this rank's block of a tensor of ``shape`` under ``pl``
    (even shards; several mesh axes on one dim outer -> inner, NOTE [shard order])."""
    names = mesh.mesh_dim_names or ()
    box = [(0, n) for n in shape]
    per_dim: dict[int, list[int]] = {}
    for i, p in enumerate(pl):
        if isinstance(p, Shard):
            per_dim.setdefault(p.dim, []).append(i)
    for d, mdims in per_dim.items():
        idx, k = 0, 1
        for i in mdims:
            idx = idx * mesh.size(i) + mesh.get_local_rank(i)
            k *= mesh.size(i)
        if shape[d] % k:
            raise LayoutError(
                f"dim {d} of size {shape[d]} is not divisible by mesh axes {[names[i] for i in mdims]} (size {k})"
            )
        n = shape[d] // k
        box[d] = (idx * n, n)
    return box


def local_slice(full: Tensor, mesh: DeviceMesh, pl: Sequence[Placement]) -> Tensor:
    """This rank's block of ``full`` (the same on every rank) under ``pl``; no communication."""
    t = full
    for d, (start, n) in enumerate(local_box(full.shape, mesh, pl)):
        if n != full.shape[d]:
            t = t.narrow(d, start, n)
    return t


def pure_data_parallel(layout: Layout, sizes: Mapping[str, int]) -> bool:
    """Compute is data parallelism only on this mesh: every mesh axis (of size > 1) splits
    ``batch`` and no other logical axis (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py),
    at the top level and in every scope (NOTE [scoped layouts] in meshlm/core/scopes.py)."""
    names = {a for a, n in sizes.items() if n > 1}
    if not names:
        return True  # one device: every block's math is the one-device math
    if not names <= set(DATA_AXES):
        return False
    return all(_batch_only(lay.compute, names) for lay in layout.all_layouts())


def _batch_only(compute: Mapping[str, tuple[str, ...]], names: set[str]) -> bool:
    if set(compute.get("batch", ())) & names != names:
        return False  # some mesh axis does not split the batch: compute is replicated over it
    for axis, mesh_axes in compute.items():
        present = {a for a in mesh_axes if a in names}
        if axis == "batch" and present != names:
            return False
        if axis != "batch" and present:
            return False
    return True


def needs_regather(pp: ParamPlan) -> bool:
    """Gathered over a data axis at use (ZeRO-3): storage shards a dim over dp/fsdp that
    compute does not."""
    for st_axes, cp_axes in zip(pp.storage, pp.compute):
        if any(a in DATA_AXES and a not in cp_axes for a in st_axes):
            return True
    return False


def full_state_dict(model: nn.Module, device: Optional[torch.device] = None) -> dict[str, Tensor]:
    """Every parameter gathered to a full plain tensor (every rank gets all; small models),
    each moved to ``device`` as soon as it is gathered (None: left where it is)."""
    out = {}
    for fqn, _m, _n, p in iter_params(model):
        t = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        out[fqn] = t if device is None else t.to(device)
    return out
