"""``shard``: lower a model in place onto a mesh under a layout (the steps of the package
docstring, in order), and the sharded classes it swaps in."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_ops
from meshlm.core import annotate, ties
from meshlm.core.axes import vocabulary
from meshlm.core.errors import LayoutError, MeshlmError
from meshlm.layout import precision
from meshlm.layout.mesh import mesh_spec
from meshlm.layout.rules import Layout, load_layout
from meshlm.runtime import hooks, in_flight
from meshlm.runtime.cp.attach import attach as cp_attach
from meshlm.runtime.lowering import root
from meshlm.runtime.lowering.atuse import UseSpec, at_use_key, make_getter, tied_getter
from meshlm.runtime.lowering.blocks import (
    allow_conduit_under_checkpoint,
    block_forward,
    block_spec,
    link_blocks,
    outer_blocks,
)
from meshlm.runtime.lowering.local_root import root_spec
from meshlm.runtime.lowering.materialize import materialize
from meshlm.runtime.lowering.params import iter_params, needs_regather, placements, plan_params
from meshlm.runtime.lowering.state import ShardState


def shard(
    model: nn.Module,
    layout: "Layout | str",
    mesh: DeviceMesh,
    *,
    seed: int = 0,
    init: bool = True,
    param_dtype: Optional[torch.dtype] = None,
    compute_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    overlap: Optional[bool] = None,
    bucket: bool = True,
    keep: Optional[set[str]] = None,
    after_block: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Lower ``model`` in place onto ``mesh`` under ``layout`` and return it.

    A model built on the meta device is initialised from ``seed`` shard by shard (the same
    values as ``meshlm.core.annotate.init_params(model, seed)`` on one device); a model holding
    real weights (the same on every rank) is distributed from those weights.  With
    ``init=False`` the shards of a meta model are left uninitialised (to be loaded into).
    ``param_dtype`` is the storage dtype of the shards (initialised in fp32, then cast);
    gradients arrive in ``.grad`` (and accumulate there) in the storage dtype.
    ``compute_dtype`` casts parameters at use (before the gather).  ``reduce_dtype`` is the
    dtype gradients are reduced in; None means float32 whenever the compute or the storage
    dtype is a float narrower than 32 bits (FSDP2's MixedPrecisionPolicy and Megatron reduce
    in fp32 too), else the gradient's own dtype; an explicit ``reduce_dtype`` wins.  Mixed
    precision as ``meshlm train`` runs it (FSDP2's semantics): fp32 storage (the master
    weights), ``compute_dtype=torch.bfloat16``, so gradients reach ``.grad`` in fp32.
    ``grad_dtype`` (None: each parameter's storage dtype) is the dtype gradients are
    accumulated in: where it differs from a parameter's storage dtype, the reduced gradient
    goes to ``param.main_grad`` in ``grad_dtype`` and ``.grad`` stays None (NOTE [main
    grads] in meshlm/runtime/main_grad.py; ``ShardedOptimizer`` reads it), as ``meshlm train`` runs ZeRO-1/2
    under mixed precision: ``param_dtype=compute_dtype=torch.bfloat16``,
    ``reduce_dtype=grad_dtype=torch.float32``.  ``overlap`` leaves each block's gradient reduction in
    flight while backward goes on (NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py; default: on
    for a CUDA mesh, off on CPU).  ``bucket=False`` turns off per-block flat collectives
    (NOTE [block buckets]): every parameter then moves on its own, a reference for the
    benchmarks.  ``keep``: the FQNs of the parameters this rank holds, the others becoming
    ``Absent`` attributes (a pipeline stage: NOTE [absent values] in meshlm/runtime/absent.py).
    ``after_block(block)`` is called as soon as each outer block's shards are made (offloaded
    parameters go to their tier there: NOTE [offloaded parameters] in meshlm/runtime/offload/params.py).
    """
    compat.dynamo_ready()  # a sharded model may be compiled (NOTE [lazy dynamo] in meshlm/_torch_compat)
    dtensor_ops.install()
    dtensor_ops.claim_mesh(mesh)  # its DTensors get meshlm's rules (NOTE [scoped patches])
    layout = load_layout(layout)
    if getattr(model, "_meshlm_state", None) is not None:
        raise MeshlmError("this model is already sharded; build a fresh model to shard it again")
    if annotate.is_block(model):
        raise MeshlmError(
            f"the model's root module ({type(model).__name__}) is marked @meshlm.block; a block is a layer the "
            "root calls (its parameters are gathered and reduced together around each call), and the root "
            "cannot call itself: remove @meshlm.block from the root and mark the layers that repeat inside it"
        )
    plans = plan_params(model, layout, mesh)
    _check_layout_axes(layout, mesh)
    cp = cp_attach(layout, mesh, model)  # NOTE [cp dispatch] in meshlm/_torch_compat/dtensor_cp.py
    materialize(model, plans, mesh, seed if init else None, param_dtype, grad_dtype, keep, after_block)
    if keep is not None:
        plans = {fqn: pp for fqn, pp in plans.items() if fqn in keep}
    if reduce_dtype is None:
        reduce_dtype = precision.default_reduce_dtype(compute_dtype, [p.dtype for p in model.parameters()])
    st = ShardState(layout, mesh, plans, compute_dtype, reduce_dtype, grad_dtype, vocab=frozenset(vocabulary(model)))
    st.overlap = mesh.device_type == "cuda" if overlap is None else bool(overlap)
    st.cp = cp  # NOTE [cp settings per model] in meshlm/runtime/cp/active.py
    in_flight.own(model.parameters(), st.in_flight)
    by_module: dict[int, tuple[nn.Module, dict[str, UseSpec]]] = {}
    for fqn, m, name, _p in iter_params(model):
        pp = plans[fqn]
        use = UseSpec(
            placements(pp.compute, mesh),
            None if pp.grads is None else placements(pp.grads, mesh),
            regather=needs_regather(pp),
        )
        use.key = at_use_key(use.compute, use.grads, compute_dtype, reduce_dtype, use.regather, grad_dtype)
        by_module.setdefault(id(m), (m, {}))[1][name] = use
    tied: dict[int, dict[str, tuple[nn.Module, str]]] = {}  # NOTE [ties] in ties.py: read through the first slot
    for m, name, first, first_name in ties.aliases(model):
        by_module.setdefault(id(m), (m, {}))
        tied.setdefault(id(m), {})[name] = (first, first_name)
    for m, uses in by_module.values():  # NOTE [attachments] in meshlm/runtime/hooks.py
        mine = tied.get(id(m), {})
        hooks.swap_class(m, hooks.LOWERING, sharded_class(type(m), tuple(uses), False, tuple(mine)))
        hooks.set_attrs(m, hooks.LOWERING, _meshlm_tied=mine, _meshlm_use=uses, _meshlm_now={}, _meshlm_state=st)
    for m in outer_blocks(model):
        spec = block_spec(m, st, bucket)
        if spec.key is None and not spec.regather:
            continue
        cls = hooks.original_class(type(m))
        cls = sharded_class(cls, tuple(getattr(m, "_meshlm_use", {})), True, tuple(getattr(m, "_meshlm_tied", {})))
        hooks.swap_class(m, hooks.LOWERING, cls)
        hooks.set_attrs(m, hooks.LOWERING, _meshlm_block=spec, _meshlm_state=st)
        if spec.regather and spec.key is not None:
            allow_conduit_under_checkpoint()
    for sc in layout.scopes:  # NOTE [scoped layouts] in meshlm/core/scopes.py
        enter_scope(model.get_submodule(sc.path), st.handler, st.scope_handler(sc.layout))
    link_blocks(model, st)
    st.has_buffers = any(True for _ in model.buffers())
    st.local_block_modules = {
        id(sub)
        for b in outer_blocks(model)
        if getattr(b, "_meshlm_block", None) and b._meshlm_block.local
        for sub in b.modules()
    }
    st.root = root_spec(model, st) if bucket else None
    root_cls = type(model)
    hooks.set_attrs(model, hooks.LOWERING, _meshlm_orig_forward=root_cls.forward)
    hooks.swap_class(model, hooks.LOWERING, hooks.derived_class(root_cls, "Sharded", {"forward": root.root_forward}))
    hooks.set_attrs(model, hooks.LOWERING, _meshlm_state=st)
    return model


def sharded_class(cls: type, names: tuple[str, ...], block: bool, tied: tuple[str, ...] = ()) -> type:
    """``Sharded<cls>``: ``cls`` whose parameter attributes ``names`` are gathered at use,
    with the block runtime's forward if ``block``; one class per (class, names, block,
    tied), shared by every instance, so that torch.compile sees the same type for every
    layer and compiles a block once.  ``tied``: attributes that read through another
    module's (NOTE [ties] in ties.py).  NOTE [sharded class names] in meshlm/runtime/hooks.py."""
    attrs = {n: make_getter(n) for n in names}
    attrs.update({n: tied_getter(n) for n in tied})
    if block:
        attrs["forward"] = block_forward
    return hooks.derived_class(cls, "Sharded", attrs, key=(names, block, tied))


def enter_scope(m: nn.Module, outer, inner) -> None:
    """Run ``m``'s forward under the scope's constraint handler ``inner`` when it is called
    under the DTensor root's ``outer`` (a local root's handler is left as it is: there
    ``constrain`` only checks axes).  Hooks, so the module's class and forward stay its own."""
    hooks.set_attrs(m, hooks.SCOPE, _meshlm_scope=(outer, inner))
    hooks.add_hooks(m, hooks.SCOPE, pre=_scope_in, post=_scope_out, always_call=True)


def _scope_in(m: nn.Module, _args) -> None:
    outer, inner = m._meshlm_scope
    if annotate.active_handler() is outer:
        m._meshlm_scope_saved = annotate.swap_handler(inner)


def _scope_out(m: nn.Module, _args, _out) -> None:
    saved = m.__dict__.pop("_meshlm_scope_saved", None)
    if saved is not None:
        annotate.restore_handler(saved)


def _check_layout_axes(layout: Layout, mesh: DeviceMesh) -> None:
    names = set(mesh.mesh_dim_names or ())
    spec = mesh_spec(mesh).as_dict()
    for a in layout.mesh_axes_used():
        if a in spec and spec[a] > 1 and a not in names:
            raise LayoutError(f"{layout.source}: mesh axis {a!r} is not a dim of this DeviceMesh")
