"""Materialisation: each rank's shards only, from a seed (the canonical init order replayed
one module at a time) or sliced from real weights that every rank holds."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshlm.core import annotate
from meshlm.core.errors import AnnotationError, MeshlmError
from meshlm.layout.mesh import mesh_spec
from meshlm.runtime import hooks, main_grad
from meshlm.runtime.absent import absent_like
from meshlm.runtime.lowering.params import ParamPlan, iter_params, local_slice, placements


def materialize(
    model: nn.Module,
    plans: dict[str, ParamPlan],
    mesh: DeviceMesh,
    seed: Optional[int],
    param_dtype: Optional[torch.dtype] = None,
    master_dtype: Optional[torch.dtype] = None,
    keep: Optional[set[str]] = None,
    after_block: Optional[Callable[[nn.Module], None]] = None,
) -> None:
    """Each rank's shards.  With a ``master_dtype`` other than the storage dtype (main
    gradients, NOTE [main grads] in meshlm/runtime/main_grad.py), each parameter also gets this rank's
    optimizer-placement block of its initial weights in ``master_dtype``, before they are
    rounded to the storage dtype (``main_grad.INIT_MASTER``), which ``ShardedOptimizer``
    takes as the master: a bf16-stored model keeps its float32 initialisation.

    ``keep``: the FQNs this rank holds (a pipeline stage's, NOTE [absent values] in
    meshlm/runtime/absent.py); every other parameter is still drawn, so that the init order is the
    one-device one, then becomes an ``Absent`` attribute of its modules.

    ``after_block(block)``: called for each outer ``@meshlm.block`` as soon as its parameters
    are made, before the next module's are (the offload of parameters moves them to their
    tier there, so the whole model is never in memory: NOTE [offloaded parameters] in
    meshlm/runtime/offload/params.py)."""
    dev = torch.device(mesh.device_type)
    owner: dict[int, str] = {}
    for fqn, _m, _n, p in iter_params(model):
        owner[id(p)] = fqn
    every = set(owner)
    first: dict[int, tuple[nn.Module, str]] = {}  # NOTE [ties] in ties.py: each parameter's first slot
    any_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    # each outer block's last module in the walk below: the block is complete once it is done
    ends = {id(list(b.modules())[-1]): b for b in annotate.outer_blocks(model)} if after_block else {}
    dropped: set[int] = set()  # ids of the parameters another stage holds (``keep``)
    placed: dict[int, torch.Tensor] = {}  # each buffer (by id) as placed: a buffer registered twice stays one
    for mname, m in model.named_modules():
        # every slot draws (the stream does not depend on ties); its first slot's draw is kept
        own = [(n, p) for n, p in m._parameters.items() if p is not None and id(p) in every]
        direct = [(n, p) for n, p in own if id(p) in owner]
        fulls = annotate.init_module(m, gen, own) if any_meta and seed is not None else {}
        for n, p in direct:
            fqn = owner.pop(id(p))
            first[id(p)] = (m, n)
            if keep is not None and fqn not in keep:
                dropped.add(id(p))
                continue
            if p.is_meta and seed is None:  # uninitialised: allocate this rank's shard only
                pl = placements(plans[fqn].storage, mesh)
                local = torch.empty(
                    plans[fqn].local_shape(plans[fqn].storage, mesh_spec(mesh).as_dict()),
                    dtype=param_dtype or p.dtype,
                    device=dev,
                )
                dt = DTensor.from_local(
                    local,
                    mesh,
                    pl,
                    run_check=False,
                    shape=torch.Size(plans[fqn].shape),
                    stride=torch.empty(plans[fqn].shape, device="meta").stride(),
                )
                m._parameters[n] = nn.Parameter(dt, requires_grad=p.requires_grad)
                continue
            if p.is_meta:
                if n not in fulls:
                    raise AnnotationError(
                        f"parameter `{fqn}` is on the meta device but {type(m).__name__} has no "
                        "init_weights(generator): define it to fill the module's own parameters, or build "
                        "the model with real weights."
                    )
                full = fulls[n]
            else:
                full = p.detach()
            pl = placements(plans[fqn].storage, mesh)
            local = local_slice(full.to("cpu") if full.device.type != dev.type else full, mesh, pl)
            src = full.to("cpu") if full.device.type != dev.type else full
            local = local.to(dev, dtype=param_dtype or p.dtype).clone().contiguous()
            stride = torch.empty(plans[fqn].shape, device="meta").stride()
            dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(plans[fqn].shape), stride=stride)
            m._parameters[n] = nn.Parameter(dt, requires_grad=p.requires_grad)
            if master_dtype is not None and master_dtype != local.dtype and p.requires_grad:
                opl = placements(plans[fqn].optimizer, mesh)
                init = local_slice(src, mesh, opl).to(dev, dtype=master_dtype).clone().contiguous()
                setattr(
                    m._parameters[n],
                    main_grad.INIT_MASTER,
                    DTensor.from_local(
                        init, mesh, opl, run_check=False, shape=torch.Size(plans[fqn].shape), stride=stride
                    ),
                )
        _place_buffers(m, mname, fulls, dev, seed, placed)
        if id(m) in ends:
            after_block(ends[id(m)])
    absents: dict[int, torch.Tensor] = {}  # one Absent per parameter, in all its slots (as one Parameter was)
    for m in model.modules(remove_duplicate=False):  # NOTE [absent values] in meshlm/runtime/absent.py
        for n, p in list(m._parameters.items()):
            if p is not None and id(p) in dropped:
                if "_meshlm_param_order" not in m.__dict__:  # where meshlm.unshard puts them back
                    hooks.set_attrs(m, hooks.LOWERING, _meshlm_param_order=tuple(m._parameters))
                del m._parameters[n]
                hooks.set_attrs(m, hooks.LOWERING, **{n: absents.setdefault(id(p), absent_like(p))})
    for m in model.modules():  # a tied parameter's other slots hold the one sharded Parameter
        for n, p in m._parameters.items():
            if p is not None and id(p) in first and first[id(p)] != (m, n):
                f, fn = first[id(p)]
                m._parameters[n] = f._parameters[fn]
    _check_no_shared_params(model)


def _place_buffers(
    m: nn.Module, mname: str, fulls: dict, dev: torch.device, seed: Optional[int], placed: dict[int, torch.Tensor]
) -> None:
    """``m``'s own buffers, whole, on ``dev``: as built, or (meta) as its ``init_weights``
    filled them (``fulls``); NOTE [buffers] in meshlm/runtime/lowering/buffers.py."""
    for n, b in list(m._buffers.items()):
        if b is None:
            continue
        if id(b) not in placed:
            if not b.is_meta:
                val = b
            elif n in fulls:
                val = fulls[n]
            elif seed is None:  # to be loaded (a checkpoint keeps the persistent ones)
                val = torch.empty(b.shape, dtype=b.dtype)
            else:
                fqn = f"{mname}.{n}" if mname else n
                raise AnnotationError(
                    f"buffer `{fqn}` (shape {tuple(b.shape)}) is on the meta device and nothing fills it: "
                    f"{type(m).__name__} has no init_weights(generator) that sets it. Fill it in "
                    f"{type(m).__name__}.init_weights (as its parameters), or build the model with real "
                    "weights (meshlm train does that for a model without init_weights: docs/train.md)."
                )
            placed[id(b)] = val.to(dev, dtype=b.dtype)
        m._buffers[n] = placed[id(b)]


def _check_no_shared_params(model: nn.Module) -> None:
    """Every slot holds a sharded parameter: none was left with the unsharded tensor."""
    for mname, m in model.named_modules(remove_duplicate=False):
        for n, p in m._parameters.items():
            if isinstance(p, nn.Parameter) and not isinstance(p.data, DTensor):
                raise MeshlmError(
                    f"internal error: parameter `{mname}.{n}` was left unsharded by meshlm.shard "
                    "(a slot of a tied parameter, NOTE [ties] in meshlm/core/ties.py, not re-pointed)"
                )
