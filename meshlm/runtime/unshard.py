"""``meshlm.unshard``: a sharded model back to the plain torch module it was.

NOTE [unshard]
    ``unshard(model, device="cpu")`` undoes ``meshlm.shard`` in place and returns the same
    object:

    - every parameter gathered whole from its shards (``full_state_dict``), a plain
      ``nn.Parameter`` on ``device`` with its ``requires_grad``; a tied parameter is again
      one Parameter in every slot.  It is collective: every rank of the mesh calls it, and
      every rank gets the whole module;
    - every buffer a plain tensor on ``device`` (a buffer registered twice stays one);
    - every attachment detached (NOTE [attachments] in meshlm/runtime/hooks.py): each
      module's class is the user's again (no ``Sharded<...>``), its call its own, no meshlm
      hook or attribute is left.  Activation checkpointing and in-place compiled blocks
      (``compile_blocks``) are meshlm's attachments too: the plain module runs uncompiled,
      without checkpointing; compile it again if wanted.

    What does not come back: gradients (the new parameters have none) and the optimizer.
    An optimizer built on the sharded parameters (``ShardedOptimizer``, or any other) keeps
    those, which the model no longer holds: its steps would not reach the model.  Build a
    new one on ``model.parameters()``.  The weights are the parameters as stored: under
    bf16 storage with float32 masters (ZeRO-1/2 mixed precision), the bf16 weights.

    Offloaded parameters (``offload.params``: NOTE [offloaded parameters] in
    meshlm/runtime/offload/params.py) are swapped in, their copies on the tier dropped,
    before they are gathered.  A pipeline (``build_pipeline``): call ``unshard(pipe.model)``
    on every rank of the whole mesh; each stage's parameters are gathered on its stage mesh
    and broadcast over ``pp`` from the stage's rank, and so are the buffers inside each
    stage's blocks (the others are each rank's own: every stage holds them); the
    ``Pipeline`` is not to be used after.  Refused with a MeshlmError: a submodule of a
    sharded model (unshard the model ``meshlm.shard`` returned), a model whose blocks are
    placed over processes for staged decoding (NOTE [staged decoding] in
    meshlm/infer/stages.py: no rank ever held the others' weights), and parameters held by
    another stage without the pipeline that says which (``meshlm.shard(keep=...)`` alone).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm.core.errors import MeshlmError
from meshlm.runtime import hooks
from meshlm.runtime.absent import Absent, absent_params
from meshlm.runtime.lowering.params import full_state_dict, iter_params
from meshlm.runtime.offload.params import OFFLOAD_ATTR


def unshard(model: nn.Module, device: Union[torch.device, str] = "cpu") -> nn.Module:
    """Make the sharded ``model`` (what ``meshlm.shard`` returned) the plain torch module it
    was, with its full weights as plain tensors on ``device``, in place; returns ``model``.
    Every rank of the mesh must call it (it gathers), and every rank gets the whole module.
    An optimizer built on the sharded parameters is not carried over: build a new one.
    NOTE [unshard] in meshlm/runtime/unshard.py says what comes back and what is refused."""
    device = torch.device(device)
    _check(model)
    offloads = {id(v[0]): v[0] for m in model.modules() if (v := m.__dict__.get(OFFLOAD_ATTR)) is not None}
    for off in offloads.values():
        off.release()
    st = model.__dict__.get("_meshlm_state")
    if st is not None:
        st.prefetch.drain()  # gathers issued ahead (NOTE [prefetch]): waited for, before other collectives
    pipe = model.__dict__.get("_meshlm_pipeline")
    full = _params(model, pipe, device)
    _put_params(model, full, device)
    _put_buffers(model, device, pipe)
    hooks.detach_all(model)
    left = [name or type(m).__name__ for name, m in hooks.attached(model)]
    if left:
        raise MeshlmError(f"internal error: meshlm.unshard left attachments on {left}")
    return model


def _check(model: nn.Module) -> None:
    if "_meshlm_state" in model.__dict__ and "_meshlm_orig_forward" not in model.__dict__:
        raise MeshlmError(
            f"meshlm.unshard: this {type(model).__name__} is a submodule of a sharded model; unshard the model that "
            "meshlm.shard returned (its root), on every rank"
        )
    staged = [name or type(m).__name__ for name, m in hooks.attached(model) if hooks.STAGES in hooks.owners(m)]
    if staged:
        raise MeshlmError(
            f"meshlm.unshard: block `{staged[0]}` (and {len(staged) - 1} more) is placed over processes for staged "
            "decoding (NOTE [staged decoding] in meshlm/infer/stages.py): each rank holds only its own blocks' "
            "weights, which were never sharded. Load the model whole on one process instead (meshlm generate "
            "without --max-memory-per-device over several devices)"
        )


def _params(model: nn.Module, pipe, device: torch.device) -> dict[str, Tensor]:
    """FQN -> every parameter whole on ``device`` (``requires_grad`` as the parameter's), on every rank."""
    absent = absent_params(model)
    if absent and pipe is None:  # refused before any collective, alike on every rank
        raise MeshlmError(
            f"meshlm.unshard: parameter `{next(iter(absent))}` (and {len(absent) - 1} more) is held by another "
            "pipeline stage (meshlm.shard(keep=...)), and this model was not built by build_pipeline, which says "
            "where each is: unshard the pipeline's model (pipe.model) on every rank, or shard without keep"
        )
    full = full_state_dict(model, device)  # collective: every rank, every parameter, in one order
    own = {fqn: full[fqn].requires_grad_(p.requires_grad) for fqn, _m, _n, p in iter_params(model)}
    return own if pipe is None else pipe.from_stages(own, pipe.cut.params, device)


def _put_params(model: nn.Module, full: dict[str, Tensor], device: torch.device) -> None:
    """Every slot of every parameter (and every ``Absent`` one) holds its plain Parameter."""
    new: dict[int, nn.Parameter] = {}
    for fqn, _m, _n, p in iter_params(model):
        new[id(p)] = _plain(p, full[fqn], device)
    first: dict[int, str] = {}
    for fqn, a in absent_params(model).items():  # named_modules order: a tied one's first name first
        first.setdefault(id(a), fqn)
    for i, fqn in first.items():
        new[i] = nn.Parameter(full[fqn].detach().to(device), requires_grad=full[fqn].requires_grad)
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[n] = new[id(p)]
        for n, v in list(vars(m).items()):
            if isinstance(v, Absent) and id(v) in new:
                m._parameters[n] = new[id(v)]  # its Absent attribute goes with the lowering's attachments
        order = m.__dict__.get("_meshlm_param_order")
        if order is not None:
            ordered = {n: m._parameters[n] for n in order if n in m._parameters}
            m._parameters.clear()
            m._parameters.update(ordered)


def _plain(p: Tensor, whole: Tensor, device: torch.device) -> nn.Parameter:
    """``p``'s plain Parameter: ``p`` itself where it is one already, on ``device``."""
    if isinstance(p, nn.Parameter) and not isinstance(p.data, DTensor) and p.device == device:
        return p
    return nn.Parameter(whole.detach().to(device), requires_grad=p.requires_grad)


def _put_buffers(model: nn.Module, device: torch.device, pipe) -> None:
    """Every buffer a plain tensor on ``device``; in a pipeline, a block's as its stage holds it."""
    own = {name: b.full_tensor() if isinstance(b, DTensor) else b for name, b in model.named_buffers()}
    if pipe is not None:
        stages = [tuple(f"{blk}." for blk in blocks) for blocks in pipe.cut.stages]
        own.update(pipe.from_stages(own, [[n for n in own if n.startswith(pre)] for pre in stages], device))
    plain = {id(b): _plain_buffer(own[name], device) for name, b in model.named_buffers()}
    for m in model.modules():
        for n, b in list(m._buffers.items()):
            if b is not None and id(b) in plain:
                m._buffers[n] = plain[id(b)]


def _plain_buffer(b: Tensor, device: torch.device) -> Tensor:
    return b if b.device == device and not b.requires_grad else b.detach().to(device)
