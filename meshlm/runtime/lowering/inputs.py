"""The sharded root's inputs: which logical axes each input leaf has, each rank's slice
of a global batch (``shard_batch``), and that slice wrapped as the global DTensor."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshlm._torch_compat import dtensor_cp
from meshlm.core import tree
from meshlm.core.axes import Axes
from meshlm.core.errors import AnnotationError, LayoutError
from meshlm.layout.mesh import mesh_spec
from meshlm.layout.rules import INPUT_MESH_AXES, Layout, load_layout, resolve
from meshlm.runtime.hooks import original_class
from meshlm.runtime.lowering.params import local_slice, placements


def input_axes(model: nn.Module, path: str, ndim: int) -> Axes:
    """The logical axes of the input leaf at ``path``: the model's ``input_axes[path]``
    (an instance attribute or a class attribute), else ``("batch", "seq", None, ...)``."""
    declared = getattr(model, "input_axes", None) or {}
    if path in declared:
        axes = tuple(declared[path])
        if len(axes) != ndim:
            raise AnnotationError(
                f"{original_class(type(model)).__name__}.input_axes[{path!r}] = {axes} names {len(axes)} axes "
                f"for an input of {ndim} dims: give one logical axis (or None) per dim"
            )
        return axes
    base: tuple = ("batch", "seq")
    return (base + (None,) * ndim)[:ndim]


def arguments(bound: inspect.BoundArguments) -> dict[str, Any]:
    """The forward's arguments by name (the items of ``**kwargs`` under their own names)."""
    out: dict[str, Any] = {}
    params = bound.signature.parameters
    for name, val in bound.arguments.items():
        if name == "self":
            continue
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(val)
        else:
            out[name] = val
    return out


def set_arguments(bound: inspect.BoundArguments, args: dict[str, Any]) -> None:
    params = bound.signature.parameters
    for name in list(bound.arguments):
        if name == "self":
            continue
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            bound.arguments[name] = {k: args[k] for k in bound.arguments[name]}
        else:
            bound.arguments[name] = args[name]


def wrap_input(st, local: Tensor, axes: Axes) -> DTensor:
    """Each rank's slice of a global input -> the global DTensor (placed by the input rules)."""
    mesh = st.mesh
    pl = st.input_placements(axes)
    gshape = list(local.shape)
    for i, p in enumerate(pl):
        if isinstance(p, Shard):
            gshape[p.dim] *= mesh.size(i)
    return DTensor.from_local(
        local.to(mesh.device_type).contiguous(),
        mesh,
        pl,
        run_check=False,
        shape=torch.Size(gshape),
        stride=torch.empty(gshape, device="meta").stride(),
    )


def balance_input(t: Tensor, pl, layout: Layout, mesh: DeviceMesh, what: str = "input") -> Tensor:
    """``t`` (a whole input) with a dim split over a balanced ``cp`` put in balanced order, so
    that the contiguous slice of it is this rank's two chunks (NOTE [balanced chunks] in
    meshlm/_torch_compat/dtensor_cp.py)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names or layout.context is None or not layout.context.balance:
        return t
    i = names.index("cp")
    n = mesh.size(i)
    if n <= 1 or not isinstance(pl[i], Shard):
        return t
    d = pl[i].dim
    if t.shape[d] % (2 * n):
        raise LayoutError(
            f"{what} of shape {tuple(t.shape)}: dim {d} (size {t.shape[d]}) is split over cp={n} in balanced chunks "
            f"({layout.source}: context.balance), so it must be a multiple of 2*cp = {2 * n}; pad or cut the "
            "sequence, or set context.balance: false"
        )
    return dtensor_cp.to_balanced(t, d, n)


def shard_batch(batch: Any, layout: "Layout | str", mesh: DeviceMesh, axes: "Axes | dict | None" = None) -> Any:
    """This rank's slice of a global input batch, as the sharded model expects it: split
    over the layout's ``batch`` (and, with context parallel, ``seq``) rules; ranks that
    differ only in tp/pp/ep get the same.  ``batch`` is a tensor (token ids of shape
    (batch, seq) by default) or any container of tensors (``meshlm.core.tree``); ``axes`` is
    the logical axes of every leaf, or a dict from leaf path (relative to ``batch``) to
    axes, with ``("batch", "seq", None, ...)`` for the leaves it does not name."""
    layout = load_layout(layout)
    sizes = mesh_spec(mesh).as_dict()

    def one(path: str, t: Tensor) -> Tensor:
        ax = axes.get(path) if isinstance(axes, dict) else axes
        ax = tuple(ax) if ax is not None else (("batch", "seq") + (None,) * t.ndim)[: t.ndim]
        where = f"input `{path}` " if path else "input "
        plan = resolve(
            ax,
            layout.compute,
            sizes,
            shape=tuple(t.shape),
            what=f"{where}{ax} of shape {tuple(t.shape)}",
            layout=layout,
            allow_mesh=INPUT_MESH_AXES,
        )
        pl = placements(plan, mesh)
        return local_slice(balance_input(t, pl, layout, mesh, f"{where}{ax}"), mesh, pl).contiguous()

    return tree.map_tensors(batch, one)


def split_sequence(batch: Any, layout: "Layout | str", mesh: DeviceMesh) -> Any:
    """This rank's share of the ``cp`` split of a batch whose rows are already this rank's
    (``meshlm train``'s loader splits the rows over dp/fsdp): each leaf's dim that the
    layout's compute rules put on ``cp`` (its ``seq``, as ``shard_batch`` reads the leaf's
    axes) cut to this rank's chunk, or its two chunks under ``context.balance`` (NOTE
    [balanced chunks] in meshlm/_torch_compat/dtensor_cp.py).  Other leaves pass as given."""
    layout = load_layout(layout)
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names or mesh.size(names.index("cp")) <= 1:
        return batch
    i = names.index("cp")
    sizes = mesh_spec(mesh).as_dict()

    def one(path: str, t: Tensor) -> Tensor:
        ax = (("batch", "seq") + (None,) * t.ndim)[: t.ndim]
        plan = resolve(
            ax,
            layout.compute,
            sizes,
            shape=None,
            what=f"input `{path}` {ax}",
            layout=layout,
            allow_mesh=INPUT_MESH_AXES,
        )
        pl = placements(plan, mesh)
        if not isinstance(pl[i], Shard):
            return t
        only = tuple(pl[i] if j == i else Replicate() for j in range(len(pl)))
        return local_slice(balance_input(t, pl, layout, mesh, f"input `{path}`"), mesh, only).contiguous()

    return tree.map_tensors(batch, one)
