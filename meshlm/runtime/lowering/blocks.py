"""The block runtime: what a lowered block does at its entry and how it re-gathers.

A block (``@meshlm.block``) whose parameters are gathered over data axes gets one bucket
(NOTE [block buckets] in meshlm/runtime/bucket/__init__.py): its forward gathers them all at once,
runs the block's own forward, and re-gathers them in backward by freeing (eager) or by
selective checkpointing (NOTE [re-gather in backward] in lowering/policies.py).  Under a
pure data-parallel layout it runs on local tensors (NOTE [local blocks])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from meshlm import _torch_compat as compat
from meshlm.core import rng
from meshlm.core.annotate import outer_blocks
from meshlm.core.axes import DATA_AXES
from meshlm.core.state import RUN, eager, scope
from meshlm.runtime import bucket, hooks
from meshlm.runtime.lowering.params import pure_data_parallel
from meshlm.runtime.lowering.policies import keep_constraints, regather_context, regather_context_local
from meshlm.runtime.lowering.state import ShardState

# How an eager re-gathering block re-gathers (see block_forward): "free" (the default:
# NOTE [free and re-gather] in meshlm/runtime/bucket/regather.py) or "recompute" (checkpointing, as compiled
# blocks do).  A switch for benchmarks/step_phases.py, which measures the one against the
# other; not a user setting.
EAGER_REGATHER = "free"


@dataclass(frozen=True)
class BlockSpec:
    """What a lowered block does at its entry (NOTE [block buckets] in meshlm/runtime/bucket/__init__.py)."""

    key: Optional[int]  # bucket index, None: no bucket (parameters go through AtUse)
    entries: tuple  # (submodule path within the block, attribute name) per bucket member
    regather: bool  # runs under selective checkpointing (ZeRO-3)
    local: bool  # may run on plain local tensors (NOTE [local blocks])
    rows: tuple[int, int] | None = None  # local: this rank's (index, count) of batch rows (NOTE [dropout keys])


def kept_gathers(m: nn.Module) -> Optional[dict]:
    """Where ``m``'s gathered parameters are kept through a pipeline step (NOTE [gathered
    once per step] in meshlm/runtime/pipeline/pipe.py; eager code only), else None."""
    if not eager():
        return None
    st = m.__dict__.get("_meshlm_state")
    return None if st is None else st.gathered


def _frees(spec: BlockSpec) -> bool:
    """Whether this forward of a re-gathering block frees and re-gathers its parameters
    (NOTE [free and re-gather] in meshlm/runtime/bucket/regather.py) instead of checkpointing: eager, recording
    autograd, and not a recompute inside backward."""
    return (
        spec.regather
        and spec.key is not None
        and EAGER_REGATHER == "free"
        and torch.is_grad_enabled()
        and eager()
        and not compat.in_backward()
    )


def block_forward(self, *args, **kwargs):
    spec: BlockSpec = self._meshlm_block
    b = bucket.BUCKETS[spec.key] if spec.key is not None else None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    # Plain tensors in (or none, called inside the local root): the root runs on local rows
    # (NOTE [local root]), and so does the block.
    plain = spec.local and (len(tensors) > 0 or RUN.local_root > 0) and not any(isinstance(a, DTensor) for a in tensors)
    local = plain or (spec.local and len(tensors) > 0 and all(bucket.batch_sharded(a, b.sizes) for a in tensors))
    # Under train's activation checkpointing (eager), that checkpoint already recomputes
    # the block, its gathers included, in backward: the block neither frees nor nests a
    # checkpoint of its own.
    outer = getattr(self, "_meshlm_outer_checkpoint", False) and eager()
    # Parameters kept gathered through a pipeline step (NOTE [gathered once per step] in
    # meshlm/runtime/pipeline/pipe.py): no freeing and no re-gathering checkpoint either.
    outer = outer or kept_gathers(self) is not None
    frees = not outer and _frees(spec)
    if not local:
        if not spec.regather or outer:
            return _run_block(self, False, *args, **kwargs)
        if frees:
            return _run_freeing(self, False, *args, **kwargs)
        return checkpoint(
            keep_constraints(_run_block), self, False, *args, use_reentrant=False, context_fn=regather_context, **kwargs
        )
    if plain:
        return run_local(self, spec, outer, frees, *args, **kwargs)
    # NOTE [local blocks] in meshlm/runtime/bucket/__init__.py: unwrap and wrap outside any checkpoint, so that the
    # checkpointed region holds plain tensors only.
    pl = tensors[0].placements
    args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
    kwargs = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
    out = run_local(self, spec, outer, frees, *args, **kwargs)
    if isinstance(out, (tuple, list)):
        return type(out)(bucket.wrap_local(o, b.mesh, b.sizes, pl) for o in out)
    return bucket.wrap_local(out, b.mesh, b.sizes, pl)


def run_local(self, spec: BlockSpec, outer: bool, frees: bool, *args, **kwargs):
    """A local block's forward on plain tensors (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py), with
    ``meshlm.dropout`` told that they are this rank's rows (NOTE [dropout keys] in rng.py),
    in the recompute of its checkpoint too."""
    return rng.on_rows(spec.rows, _run_local_rows)(self, spec, outer, frees, *args, **kwargs)


def _run_local_rows(self, spec: BlockSpec, outer: bool, frees: bool, *args, **kwargs):
    if frees:
        out = _run_freeing(self, True, *args, **kwargs)
    elif spec.regather and not outer:
        # Without freeing, a local block re-gathers by recomputing all of its forward in
        # eager mode (it keeps only its input; EAGER_REGATHER = "recompute").  Under
        # torch.compile a full recompute fails in the partitioner (it would save the
        # DTensor parameters' mesh for backward), so compiled local blocks keep their
        # matmul and attention outputs (selective), whose policy costs only at trace time.
        run = rng.on_rows(spec.rows, _run_block)
        if torch.compiler.is_compiling():
            out = checkpoint(run, self, True, *args, use_reentrant=False, context_fn=regather_context_local, **kwargs)
        else:
            out = checkpoint(run, self, True, *args, use_reentrant=False, **kwargs)
    else:
        out = _run_block(self, True, *args, **kwargs)
    return out


def _run_block(self, local: bool, *args, _keep: Optional[list] = None, **kwargs):
    spec: BlockSpec = self._meshlm_block
    base = type(self).__meshlm_user__.forward  # the user's forward (NOTE [sharded class names] in runtime/hooks.py)
    if spec.key is None:
        return base(self, *args, **kwargs)
    mods = [submodule(self, path) for path, _n in spec.entries]
    params = [m._parameters[n] for m, (_p, n) in zip(mods, spec.entries)]
    site = None
    kept = kept_gathers(self)
    gathered = None if kept is None else kept.get(id(self))
    if gathered is not None:
        pass  # NOTE [gathered once per step] in meshlm/runtime/pipeline/pipe.py: an earlier micro-batch's
    elif eager():  # NOTE [prefetch]: which model's block this is (eager code only)
        pos = self.__dict__.get("_meshlm_pos")
        site = None if pos is None else (self._meshlm_state.prefetch, pos)
        with scope(site=site):
            gathered = bucket.gather(spec.key, local, *params)
    else:
        gathered = bucket.gather(spec.key, local, *params)
    if kept is not None:
        kept[id(self)] = gathered
    if _keep is not None:
        freed = bucket.Freed(
            spec.key, params, [compat.local_tensor(t) if isinstance(t, DTensor) else t for t in gathered], local, site
        )
        _keep.append(freed)
        bucket.free_after_backward(freed, gathered)
    for m, (_p, n), t in zip(mods, spec.entries, gathered):
        m._meshlm_now[n] = t
    # NOTE [compiled body] in compile.py: only the math is compiled; the gather above and
    # the reduction in its backward stay eager.
    body = self.__dict__.get("_meshlm_body") if local else None
    try:
        if body is not None and eager():
            return body(self, *args, **kwargs)
        return base(self, *args, **kwargs)
    finally:
        for m, (_p, n) in zip(mods, spec.entries):
            m._meshlm_now.pop(n, None)


def _run_freeing(self, local: bool, *args, **kwargs):
    """The block's forward, then its gathered parameters freed until backward re-gathers
    them (NOTE [free and re-gather] in meshlm/runtime/bucket/regather.py)."""
    keep: list = []
    out = _run_block(self, local, *args, _keep=keep, **kwargs)
    return bucket.free_after(keep[0], out)


def link_blocks(model: nn.Module, st: ShardState) -> None:
    """Tell the buckets the blocks' forward order (NOTE [prefetch] in meshlm/runtime/bucket/prefetch.py)."""
    keyed = [
        blk
        for blk in outer_blocks(model)
        if getattr(blk, "_meshlm_block", None) is not None and blk._meshlm_block.key is not None
    ]
    for n, blk in enumerate(keyed):
        hooks.set_attrs(blk, hooks.LOWERING, _meshlm_pos=n)
    st.prefetch.link([blk._meshlm_block.key for blk in keyed], [_stored_params(blk) for blk in keyed])


def _stored_params(blk: nn.Module):
    spec: BlockSpec = blk._meshlm_block
    return lambda: [submodule(blk, path)._parameters[n] for path, n in spec.entries]


def submodule(m: nn.Module, path: str) -> nn.Module:
    """``m.get_submodule(path)`` by plain attribute access (what torch.compile traces best:
    every layer of a block class then shares one compiled graph)."""
    if path:
        for part in path.split("."):
            m = getattr(m, part)
    return m


# One BlockSpec object per distinct content, shared by every layer of a block class, so the
# compiled graph of a block does not specialise on which layer it runs.  A process-wide
# interning table of immutable values (NOTE [process-wide tables] in meshlm/runtime/state.py).
_SPECS: dict[BlockSpec, BlockSpec] = {}


def block_spec(blk: nn.Module, st: ShardState, use_bucket: bool = True) -> BlockSpec:
    """Bucket every parameter of ``blk`` whose move to compute is a gather over data axes
    (NOTE [block buckets]); decide whether the block may run on local tensors."""
    names = st.names
    data_dims = tuple(i for i, n in enumerate(names) if n in DATA_AXES)
    entries, members, regather = [], [], False
    pure = pure_data_parallel(st.layout, st.sizes)
    # Parameters replicated over cp get gradients Partial over cp; a bucket sums them in one
    # flat all-reduce per block (NOTE [cp gradients in buckets] in meshlm/runtime/bucket/__init__.py).
    reduces = bool(data_dims) or pure or st.sizes.get("cp", 1) > 1
    for path, sub in blk.named_modules():
        for name, use in getattr(sub, "_meshlm_use", {}).items():
            regather |= use.regather
            p = sub._parameters[name]
            mem = bucket.member(p.placements, use.compute, use.grads, tuple(p.shape), p.dtype, data_dims)
            if mem is not None and reduces and use_bucket:
                entries.append((path, name))
                members.append(mem)
    if not entries:
        spec = BlockSpec(None, (), regather, False)
        return _SPECS.setdefault(spec, spec)
    local = pure and all(whole_in_compute(mem, st) for mem in members)
    rows = (rng.rank_index(st.coord, [st.sizes[n] for n in st.names]), st.mesh.size()) if local else None
    spec = BlockSpec(register_bucket(st, members, local), tuple(entries), regather, local, rows)
    return _SPECS.setdefault(spec, spec)


def whole_in_compute(mem: bucket.Member, st: ShardState) -> bool:
    """The parameter is whole on every rank in compute (so it may be used on local rows)."""
    return all(isinstance(pl, Replicate) or n == 1 for pl, n in zip(mem.compute, (st.sizes[a] for a in st.names)))


def register_bucket(st: ShardState, members: Sequence[bucket.Member], local: bool) -> int:
    """The index of the bucket of ``members`` on the model's mesh (NOTE [block buckets])."""
    mesh, names = st.mesh, st.names
    return bucket.register(
        bucket.Bucket(
            mesh,
            tuple(mesh.get_group(i).group_name for i in range(len(names))),
            tuple(st.sizes[n] for n in names),
            tuple(i for i, n in enumerate(names) if n in DATA_AXES),
            tuple(members),
            st.compute_dtype,
            st.reduce_dtype,
            local,
            st.overlap,
            st.grad_dtype,
        ),
        st,  # the bucket's slot holds it while this model lives
    )


def allow_conduit_under_checkpoint() -> None:
    """A bucketed block hands its gathered parameters to the parameter getters through
    ``module._meshlm_now``, a dict written and cleared inside the block's forward.  Under
    torch.compile that write sits inside the checkpointed (re-gathering) region, which
    Dynamo refuses by default because eager checkpointing would replay Python side effects
    in backward.  Here the dict is only a conduit within one trace (written, read, cleared),
    and the recompute is the traced graph's, so not replaying it is exactly right."""
    compat.allow_side_effects_under_checkpoint()
