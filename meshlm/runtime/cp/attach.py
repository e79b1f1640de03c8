"""Context parallel for one sharded model: the layout's ``context`` section checked against
the mesh, and meshlm's DTensor rules told how attention runs on it (NOTE [cp dispatch] in
meshlm/_torch_compat/dtensor_cp.py)."""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshlm._torch_compat import dtensor_cp
from meshlm.core.errors import LayoutError
from meshlm.layout.context import ContextSpec
from meshlm.layout.mesh import mesh_spec
from meshlm.layout.rules import Layout


def context_of(layout: Layout) -> ContextSpec:
    return layout.context if layout.context is not None else ContextSpec()


def check_context(layout: Layout, sizes: dict) -> None:
    """What cp needs: the vocabulary whole in compute (the vocab-parallel loss takes rows
    split over one mesh axis only); under balanced chunks (NOTE [balanced chunks]) the
    sequence split over cp alone and no parameter stored over cp.  A LayoutError naming the
    key otherwise."""
    if sizes.get("cp", 1) <= 1:
        return
    for lay in layout.all_layouts():
        if any(sizes.get(a, 1) > 1 for a in lay.compute.get("vocab", ())):
            raise LayoutError(
                f"{layout.source}: compute.vocab: {list(lay.compute['vocab'])} with the sequence split over cp: the "
                "vocab-parallel loss takes logits whose rows are split over one mesh axis, and under cp they are "
                "split over the batch axes and cp; remove vocab from compute (and params) so the output layer is "
                "gathered at use, as layouts/fsdp_tp_cp.yaml does"
            )
    if not context_of(layout).balance:
        return
    for lay in layout.all_layouts():
        for sec in ("params", "grads", "optimizer"):
            rules = lay.rules(sec)
            if not isinstance(rules, dict):
                continue
            for axis, mesh_axes in rules.items():
                if "cp" in mesh_axes:
                    raise LayoutError(
                        f"{layout.source}: {sec}.{axis}: {list(mesh_axes)} stores {axis} over cp, and "
                        "context.balance: true orders the chunks of a cp split for the sequence only; store "
                        "parameters over dp/fsdp, or set context.balance: false"
                    )
        for axis, mesh_axes in lay.compute.items():
            if "cp" in mesh_axes and len([a for a in mesh_axes if sizes.get(a, 1) > 1]) > 1:
                raise LayoutError(
                    f"{layout.source}: compute.{axis}: {list(mesh_axes)} splits {axis} over cp and another mesh axis; "
                    "with context.balance: true a dim split over cp is split over cp alone (set "
                    "context.balance: false, or drop the other axis)"
                )


def attach(layout: Layout, mesh: DeviceMesh, model: nn.Module) -> Optional[dtensor_cp.CpMesh]:
    """Register ``model``'s cp settings on ``mesh`` (if its cp axis has more than one rank)
    with meshlm's DTensor rules, and return them (NOTE [cp settings per model] in active.py)."""
    sizes = mesh_spec(mesh).as_dict()
    n = sizes.get("cp", 1)
    if n <= 1:
        return None
    check_context(layout, sizes)
    from meshlm.runtime.cp import active, ops, refuse  # NOTE [cp ops]: opaque to torch.compile

    ctx = context_of(layout)
    names = tuple(mesh.mesh_dim_names or ())
    ref = weakref.ref(model)
    spec = dtensor_cp.CpMesh(
        mesh,
        names.index("cp"),
        n,
        ctx.balance,
        ops.forward,
        ops.backward,
        ctx.attention,
        refuse.refuse,
        owner=str(layout.source),
        alive=lambda: ref() is not None,
    )
    active.register(spec)
    return spec
