"""Lowering: model + Layout + DeviceMesh -> DTensor parameters and redistributes.

This is the only module that builds Placements.  ``shard`` does, in place:

1. plans every parameter (``plan_params``): its logical axes resolved under the layout's
   ``params``, ``compute``, ``grads`` and ``optimizer`` sections;
2. materialises each rank's shard only (from a seed by replaying the canonical init order
   one module at a time, or sliced from real weights that every rank holds);
3. swaps each module's class for a subclass whose parameter attributes redistribute the
   stored DTensor to its compute placements at use (SimpleFSDP's gather-at-use), through
   ``_AtUse``, whose backward reduces the gradient to the layout's ``grads`` placements, so
   the all-gather and the reduce-scatter are ordinary autograd-traced ops;
4. wraps the root forward (``meshlm/root.py``): every tensor leaf of the inputs (each
   rank's local slice) becomes a DTensor per the input rules, ``constrain`` points
   redistribute activations, plain tensors made inside forward are treated as replicated,
   and a scalar loss comes back as a plain tensor.  Under a pure data-parallel layout the
   root runs on local tensors instead and its outputs are lifted back (NOTE [local root]).

Parameter names (FQNs) are those of the unsharded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshlm import _dtensor_ops, annotate, bucket, main_grad, precision, rng, ties
from meshlm.annotate import is_block
from meshlm.axes import DATA_AXES, Axes, check_layout_keys, vocabulary
from meshlm.errors import AnnotationError, LayoutError, MeshlmError
from meshlm.layout import INPUT_MESH_AXES, DimPlan, Layout, load_layout, resolve
from meshlm.mesh import MeshSpec, mesh_spec


# --------------------------------------------------------------------------- planning
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


def plan_params(model: nn.Module, layout: Layout, mesh: "Mapping[str, int] | MeshSpec | DeviceMesh") -> dict[str, ParamPlan]:
    """Plan every parameter of ``model`` under ``layout`` on a mesh of the given sizes.

    Raises :class:`AnnotationError` for a parameter without logical axes (never silently
    replicated), :class:`AxisError` for a logical axis, in the model or the layout, that
    is neither standard nor declared by the model (NOTE [open vocabulary] in axes.py), and
    :class:`LayoutError` for axes that do not fit the mesh.  A tied parameter (one
    Parameter in several modules) is planned once, under its first FQN (NOTE [ties]).
    """
    sizes = _sizes(mesh)
    known = vocabulary(model)
    check_layout_keys(layout, known, type(model).__name__)
    slots = ties.slots(model)
    ties.aliases(model)  # a tie meshlm cannot lower is an error here already
    out: dict[str, ParamPlan] = {}
    for fqn, m, name, p in iter_params(model):
        axes = ties.param_axes(slots[id(p)], p, known)
        what = f"param `{fqn}`"
        shape = tuple(p.shape)
        kw = dict(shape=shape, what=what, layout=layout, known=known)
        storage = resolve(axes, layout.params, sizes, section="params", **kw)
        compute = resolve(axes, layout.compute, sizes, section="compute", **kw)
        g = layout.grad_rules
        grads = None if g == "local" else resolve(axes, g, sizes, section="grads" if layout.grads else "params", **kw)  # type: ignore[arg-type]
        opt_sec = "optimizer" if layout.optimizer is not None else ("grads" if isinstance(layout.grads, dict) else "params")
        optim = resolve(axes, layout.optimizer_rules, sizes, section=opt_sec, **kw)
        out[fqn] = ParamPlan(fqn, axes, shape, p.dtype, storage, compute, grads, optim)
    return out


def _sizes(mesh: "Mapping[str, int] | MeshSpec | DeviceMesh") -> dict[str, int]:
    if isinstance(mesh, DeviceMesh):
        return mesh_spec(mesh).as_dict()
    if isinstance(mesh, MeshSpec):
        return mesh.as_dict()
    return dict(mesh)


def placements(plan: DimPlan, mesh: "DeviceMesh | tuple[str, ...]") -> tuple[Placement, ...]:
    """DTensor placements (one per mesh dim) for a per-tensor-dim plan.

    NOTE [shard order]: several mesh axes on one dim are listed outer -> inner in mesh
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
            raise LayoutError(f"dim {d} of size {shape[d]} is not divisible by mesh axes "
                              f"{[names[i] for i in mdims]} (size {k})")
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


# --------------------------------------------------------------------------- gather at use
class _AtUse(torch.autograd.Function):
    """NOTE [at-use under compile]: Dynamo traces an autograd.Function's backward ahead of
    time with a gradient that has the forward output's placements (Replicate for a gathered
    weight), while the real gradient of a weight used on a batch-sharded input is Partial.
    Traced that way, the reduction would be dropped.  ``_at_use`` hides the Function from
    Dynamo so AOTAutograd traces it on the real placements.

    Forward: stored DTensor -> compute placements (and compute dtype).  Backward: the
    gradient -> ``grads`` placements (Partial becomes all-reduce or reduce-scatter), in the
    reduce dtype; with local grads (ZeRO-1) Partial stays Partial until the optimizer step."""

    @staticmethod
    def forward(ctx, p, compute, grads, dtype, reduce_dtype, regather, grad_dtype=None):  # type: ignore[override]
        ctx.storage = p.placements
        ctx.grads = grads
        ctx.pdtype = p.dtype
        ctx.reduce_dtype = reduce_dtype
        # NOTE [main grads] in main_grad.py: the reduced gradient goes to p.main_grad
        ctx.main = (p, grad_dtype) if grad_dtype is not None and grad_dtype != p.dtype else None
        _GATHERING[0] += int(regather)
        try:
            x = p if dtype is None or p.dtype == dtype else p.to(dtype)
            if tuple(x.placements) != tuple(compute):
                x = x.redistribute(p.device_mesh, compute)
                if regather:
                    x = _dtensor_ops.waited(x)
            x = x.view_as(x) if x is p else x
        finally:
            _GATHERING[0] -= int(regather)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.reduce_dtype is not None and g.dtype != ctx.reduce_dtype:
            g = g.to(ctx.reduce_dtype)
        if ctx.grads is None:  # local: keep Partial, follow storage elsewhere
            target = tuple(gp if gp.is_partial() else sp for gp, sp in zip(g.placements, ctx.storage))
        else:
            target = ctx.grads
        # Reduce-scatter first, then all-reduce what is left, on the scattered shard: HSDP
        # all-reduces 1/fsdp of the gradient over dp, not all of it (DTensor alone would
        # reduce mesh axes in mesh order, dp first).
        first = tuple(t if gp.is_partial() and isinstance(t, Shard) else gp for gp, t in zip(g.placements, target))
        if first != tuple(g.placements) and first != tuple(target):
            g = g.redistribute(g.device_mesh, first)
        # Unconditional: a no-op when the placements already agree at run time.
        g = g.redistribute(g.device_mesh, target)
        if ctx.main is not None:
            main_grad.accumulate(ctx.main[0], g, ctx.main[1])
            return None, None, None, None, None, None, None
        if g.dtype != ctx.pdtype:
            g = g.to(ctx.pdtype)
        return g, None, None, None, None, None, None


# What each at-use parameter does (compute, grads, dtype, reduce_dtype, regather, grad_dtype), by key:
# ``_at_use`` takes the key, not the placements, because torch 2.11's Dynamo cannot pass
# Placement objects into an allow_in_graph function ("Missing as_proxy()"); an int it can.
_AT_USE: list[tuple] = []
_AT_USE_KEYS: dict[tuple, int] = {}


def _at_use_key(compute, grads, dtype, reduce_dtype, regather, grad_dtype=None) -> int:
    args = (tuple(compute), None if grads is None else tuple(grads), dtype, reduce_dtype, bool(regather), grad_dtype)
    if args not in _AT_USE_KEYS:
        _AT_USE_KEYS[args] = len(_AT_USE)
        _AT_USE.append(args)
    return _AT_USE_KEYS[args]


@torch._dynamo.allow_in_graph
def _at_use(p, key: int):
    """``_AtUse`` as one opaque node for Dynamo, so that AOTAutograd (which sees the real
    gradient placements, Partial included) traces its backward; Dynamo would trace it with a
    gradient guessed from the forward output's placements (NOTE [at-use under compile]).
    ``key``: see ``_at_use_key``."""
    return _AtUse.apply(p, *_AT_USE[key])


# NOTE [re-gather in backward]
#     ZeRO-3 frees a gathered parameter after its use in forward and gathers it again in
#     backward.  Autograd would instead keep the gathered tensor alive (F.linear saves its
#     weight), which is ZeRO-2's memory.  So each block whose parameters are gathered over a
#     data axis runs under selective activation checkpointing: every op's output is saved as
#     usual except the ops of those gathers (counted in ``_GATHERING`` while ``_AtUse``
#     gathers), which are recomputed, i.e. re-gathered, in backward.  It works the same in
#     eager mode and under torch.compile (SimpleFSDP's approach).  A block whose parameters
#     are bucketed (NOTE [block buckets] in bucket.py) gathers them all in one op at its
#     entry, which the recompute re-runs: one flat all-gather per block in backward too.
#     The tp activation collectives' outputs are saved (``_SAVED_COLLECTIVES``), so the
#     recompute re-runs only the gathers among the block's collectives.  This is the path of
#     compiled blocks and of unbucketed blocks; an eager bucketed block frees its gathered
#     parameters after forward and gathers them again in backward instead, recomputing
#     nothing (NOTE [free and re-gather] in bucket.py; ``EAGER_REGATHER``), and an eager
#     block under train's activation checkpointing is re-gathered by that checkpoint's
#     recompute alone.
_GATHERING = bucket._GATHERING


def _regather_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if not _GATHERING[0] and ((op in _SAVED_OPS and _has_dtensor(args)) or op in _SAVED_COLLECTIVES
                              or _random(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _has_dtensor(args) -> bool:
    return any(isinstance(a, DTensor) for a in args)


# Which outputs a re-gathering block keeps for backward: its matmuls and attention (the
# expensive ops, as torchtitan's selective checkpointing keeps), never a gathered weight.
# Everything else (norms, activations, RoPE, views) is recomputed in backward.
#
# Why so few: checkpointing matches the ops of the recompute with those of the forward by
# per-op call counts, and it sees ops at two levels, a DTensor op and the plain-tensor ops
# DTensor runs inside it (local kernels, collectives, waits).  A saved op is not run again
# in the recompute, so whatever it ran inside is not seen again and later counts would
# shift onto the wrong saved outputs.  Matmuls and attention run no DTensor op inside, and
# plain-tensor ops are never saved, so a shift can only pair recompute with recompute.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    if hasattr(torch.ops.aten, _name):
        _SAVED_OPS.add(getattr(torch.ops.aten, _name).default)


# The activation collectives of tensor and sequence parallelism (the reductions of the
# o-projection and down-projection outputs, the all-gathers of the SP block inputs) are
# saved too, so that re-gathering the parameters does not re-run them: backward moves the
# same bytes as without checkpointing (torchtitan's selective policy also keeps its
# reduce-scatters).  These are plain-tensor ops that run nothing inside, so saving them
# cannot shift the recompute's op counts (above).  The parameter gathers are not saved
# (``_GATHERING``): re-running them is the point.
_SAVED_COLLECTIVES = {getattr(torch.ops._c10d_functional, _name).default
                      for _name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "wait_tensor")}


def _random(op) -> bool:
    """A random op (meshlm.dropout's key draw, NOTE [dropout keys] in rng.py): saved, so
    that the recompute uses the forward's draw.  In eager mode the checkpoint's restored
    RNG state would redraw it equally; a compiled graph cannot recompute a random op (the
    partitioner then keeps the re-gathered parameters' mesh for backward and fails).  A
    plain-tensor op that runs nothing inside, so saving it cannot shift the recompute's op
    counts (above)."""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _regather_policy_local(ctx, op, *args, **kwargs):
    """The selective policy of a compiled local block (NOTE [local blocks] in bucket.py):
    plain tensors only, one dispatch level, so matmul and attention outputs are saved as
    they are."""
    from torch.utils.checkpoint import CheckpointPolicy

    if not _GATHERING[0] and (op in _SAVED_OPS or _random(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _regather_context_local():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_regather_policy_local)


def _regather_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_regather_policy)


# How an eager re-gathering block re-gathers (see _block_forward): "free" (the default:
# NOTE [free and re-gather] in bucket.py) or "recompute" (checkpointing, as compiled
# blocks do).  A switch for benchmarks/step_phases.py, which measures the one against the
# other; not a user setting.
EAGER_REGATHER = "free"


@dataclass(frozen=True)
class _BlockSpec:
    """What a lowered block does at its entry (NOTE [block buckets] in bucket.py)."""

    key: Optional[int]  # bucket index, None: no bucket (parameters go through _AtUse)
    entries: tuple  # (submodule path within the block, attribute name) per bucket member
    regather: bool  # runs under selective checkpointing (ZeRO-3)
    local: bool  # may run on plain local tensors (NOTE [local blocks])
    rows: tuple[int, int] | None = None  # local: this rank's (index, count) of batch rows (NOTE [dropout keys])


def _frees(spec: _BlockSpec) -> bool:
    """Whether this forward of a re-gathering block frees and re-gathers its parameters
    (NOTE [free and re-gather] in bucket.py) instead of checkpointing: eager, recording
    autograd, and not a recompute inside backward."""
    return (spec.regather and spec.key is not None and EAGER_REGATHER == "free" and torch.is_grad_enabled()
            and bucket._eager() and torch._C._current_graph_task_id() == -1)


def _block_forward(self, *args, **kwargs):
    spec: _BlockSpec = self._meshlm_block
    b = bucket._BUCKETS[spec.key] if spec.key is not None else None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    # Plain tensors in: the root runs on local rows (NOTE [local root]), and so does the block.
    plain = spec.local and len(tensors) > 0 and not any(isinstance(a, DTensor) for a in tensors)
    local = plain or (spec.local and len(tensors) > 0 and all(bucket.batch_sharded(a, b.sizes) for a in tensors))
    # Under train's activation checkpointing (eager), that checkpoint already recomputes
    # the block, its gathers included, in backward: the block neither frees nor nests a
    # checkpoint of its own.
    outer = getattr(self, "_meshlm_outer_checkpoint", False) and bucket._eager()
    frees = not outer and _frees(spec)
    if not local:
        if not spec.regather or outer:
            return _run_block(self, False, *args, **kwargs)
        if frees:
            return _run_freeing(self, False, *args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(keep_constraints(_run_block), self, False, *args, use_reentrant=False,
                          context_fn=_regather_context, **kwargs)
    if plain:
        return _run_local(self, spec, outer, frees, *args, **kwargs)
    # NOTE [local blocks] in bucket.py: unwrap and wrap outside any checkpoint, so that the
    # checkpointed region holds plain tensors only.
    pl = tensors[0].placements
    args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
    kwargs = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
    out = _run_local(self, spec, outer, frees, *args, **kwargs)
    if isinstance(out, (tuple, list)):
        return type(out)(bucket.wrap_local(o, b.mesh, b.sizes, pl) for o in out)
    return bucket.wrap_local(out, b.mesh, b.sizes, pl)


def _run_local(self, spec: _BlockSpec, outer: bool, frees: bool, *args, **kwargs):
    """A local block's forward on plain tensors (NOTE [local blocks] in bucket.py), with
    ``meshlm.dropout`` told that they are this rank's rows (NOTE [dropout keys] in rng.py),
    in the recompute of its checkpoint too."""
    return rng.on_rows(spec.rows, _run_local_rows)(self, spec, outer, frees, *args, **kwargs)


def _run_local_rows(self, spec: _BlockSpec, outer: bool, frees: bool, *args, **kwargs):
    if frees:
        out = _run_freeing(self, True, *args, **kwargs)
    elif spec.regather and not outer:
        from torch.utils.checkpoint import checkpoint

        # Without freeing, a local block re-gathers by recomputing all of its forward in
        # eager mode (it keeps only its input; EAGER_REGATHER = "recompute").  Under
        # torch.compile a full recompute fails in the partitioner (it would save the
        # DTensor parameters' mesh for backward), so compiled local blocks keep their
        # matmul and attention outputs (selective), whose policy costs only at trace time.
        run = rng.on_rows(spec.rows, _run_block)
        if torch.compiler.is_compiling():
            out = checkpoint(run, self, True, *args, use_reentrant=False, context_fn=_regather_context_local,
                             **kwargs)
        else:
            out = checkpoint(run, self, True, *args, use_reentrant=False, **kwargs)
    else:
        out = _run_block(self, True, *args, **kwargs)
    return out


def _run_block(self, local: bool, *args, _keep: Optional[list] = None, **kwargs):
    spec: _BlockSpec = self._meshlm_block
    base = type(self).__mro__[1].forward
    if spec.key is None:
        return base(self, *args, **kwargs)
    mods = [_submodule(self, path) for path, _n in spec.entries]
    params = [m._parameters[n] for m, (_p, n) in zip(mods, spec.entries)]
    gathered = bucket.gather(spec.key, local, *params)
    if _keep is not None:
        freed = bucket.Freed(spec.key, params, [t._local_tensor if isinstance(t, DTensor) else t
                                                for t in gathered], local)
        _keep.append(freed)
        bucket.free_after_backward(freed, gathered)
    for m, (_p, n), t in zip(mods, spec.entries, gathered):
        m._meshlm_now[n] = t
    # NOTE [compiled body] in compile.py: only the math is compiled; the gather above and
    # the reduction in its backward stay eager.
    body = self.__dict__.get("_meshlm_body") if local else None
    try:
        if body is not None and bucket._eager():
            return body(self, *args, **kwargs)
        return base(self, *args, **kwargs)
    finally:
        for m, (_p, n) in zip(mods, spec.entries):
            m._meshlm_now.pop(n, None)


def _run_freeing(self, local: bool, *args, **kwargs):
    """The block's forward, then its gathered parameters freed until backward re-gathers
    them (NOTE [free and re-gather] in bucket.py)."""
    keep: list = []
    out = _run_block(self, local, *args, _keep=keep, **kwargs)
    return bucket.free_after(keep[0], out)


def keep_constraints(fn):
    """``fn`` with the constrain handler active now (inside the sharded forward) also
    active when torch.utils.checkpoint re-runs it in backward, outside the root forward.
    Without it, the recompute sees ``constrain`` as the identity: a Partial attention
    output stays Partial into the MLP, so the saved inputs differ from forward's and the
    weight gradients come out Partial over tp at full size (extra reduce-scatters)."""
    handler = annotate._handler

    def run(*args, **kwargs):
        if annotate._handler is handler:
            return fn(*args, **kwargs)
        prev, annotate._handler = annotate._handler, handler
        try:
            return fn(*args, **kwargs)
        finally:
            annotate._handler = prev

    return run


@dataclass
class _UseSpec:
    compute: tuple[Placement, ...]
    grads: Optional[tuple[Placement, ...]]
    regather: bool = False
    key: int = -1  # _at_use_key of these and the model's dtypes
    local_key: Optional[int] = None  # NOTE [local root]: its one-member bucket, gathered at use


_LOCAL_ROOT = [0]  # > 0 while a root runs on local tensors (NOTE [local root] in root.py)


def _make_getter(name: str):
    def get(self):
        now = self._meshlm_now
        if name in now:  # gathered by the enclosing block's bucket
            return now[name]
        p = self._parameters[name]
        use = self._meshlm_use[name]
        if _LOCAL_ROOT[0] and use.local_key is not None:  # NOTE [local root]
            return bucket.gather(use.local_key, True, p)[0]
        return _at_use(p, use.key)

    return property(get)


def _tied_getter(name: str):
    def get(self):
        first, first_name = self._meshlm_tied[name]
        return getattr(first, first_name)

    return property(get)


# --------------------------------------------------------------------------- lowered state
@dataclass
class ShardState:
    """What ``shard`` attaches to the root module (``model._meshlm_state``)."""

    layout: Layout
    mesh: DeviceMesh
    plans: dict[str, ParamPlan]
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    grad_dtype: Optional[torch.dtype] = None  # NOTE [main grads] in main_grad.py
    # Plain copies of the mesh's names and sizes: traced code must not read attributes off
    # the DeviceMesh (an opaque object to torch.compile).
    sizes: dict[str, int] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    overlap: bool = False  # NOTE [overlapped reduction] in bucket.py
    root: Optional[object] = None  # root.RootSpec (NOTE [local root] in root.py); None: under DTensor
    coord: tuple[int, ...] = ()  # this rank's coordinate on the mesh
    handler: rng.Handler | None = None  # what annotate calls under the DTensor root: constrain, dropout
    vocab: frozenset = frozenset()  # the model's logical axes (NOTE [open vocabulary] in axes.py)

    def __post_init__(self) -> None:
        self.sizes = mesh_spec(self.mesh).as_dict()
        self.names = tuple(self.mesh.mesh_dim_names or ())
        self.coord = tuple(self.mesh.get_coordinate() or (0,) * len(self.names))
        self.handler = rng.Handler(self.constrain, self.coord, tuple(self.sizes[n] for n in self.names))

    def placements(self, plan: DimPlan) -> tuple[Placement, ...]:
        return placements(plan, self.names)

    def activation_placements(self, axes: Axes, shape: Sequence[int]) -> tuple[Placement, ...]:
        plan = resolve(tuple(axes), self.layout.compute, self.sizes, shape=tuple(shape),
                       what=f"activation {tuple(axes)} of shape {tuple(shape)}", layout=self.layout, known=self.vocab)
        return placements(plan, self.names)

    def input_placements(self, axes: Axes) -> tuple[Placement, ...]:
        """Placements of an input given as each rank's local slice (any local size works:
        the global size is the local one times the mesh axes splitting it)."""
        plan = resolve(tuple(axes), self.layout.compute, self.sizes, what=f"input {tuple(axes)}",
                       layout=self.layout, allow_mesh=INPUT_MESH_AXES, known=self.vocab)
        return placements(plan, self.names)

    def constrain(self, x: Tensor, axes: Axes) -> Tensor:
        if not isinstance(x, DTensor):
            return x
        if len(axes) != x.ndim:
            raise AnnotationError(f"constrain: {len(axes)} logical axes {tuple(axes)} for a tensor of {x.ndim} dims {tuple(x.shape)}")
        pl = self.activation_placements(axes, x.shape)
        # Always through redistribute, even when the placements already agree: its backward
        # puts the gradient at the same placements, so a Partial gradient is reduced here
        # (Megatron's "f" operator at the input of a tensor-parallel block) rather than
        # carried through the residual stream and reduced later per weight.
        return x.redistribute(x.device_mesh, pl)


def shard_state(model: nn.Module) -> ShardState:
    st = getattr(model, "_meshlm_state", None)
    if st is None:
        raise MeshlmError("this module was not lowered: call meshlm.shard(model, layout, mesh) first")
    return st


# --------------------------------------------------------------------------- shard
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
) -> nn.Module:
    """Lower ``model`` in place onto ``mesh`` under ``layout`` and return it.

    A model built on the meta device is initialised from ``seed`` shard by shard (the same
    values as ``meshlm.annotate.init_params(model, seed)`` on one device); a model holding
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
    grads] in main_grad.py; ``ShardedOptimizer`` reads it), as ``meshlm train`` runs ZeRO-1/2
    under mixed precision: ``param_dtype=compute_dtype=torch.bfloat16``,
    ``reduce_dtype=grad_dtype=torch.float32``.  ``overlap`` leaves each block's gradient reduction in
    flight while backward goes on (NOTE [overlapped reduction] in bucket.py; default: on
    for a CUDA mesh, off on CPU).  ``bucket=False`` turns off per-block flat collectives
    (NOTE [block buckets]): every parameter then moves on its own, a reference for the
    benchmarks.
    """
    _dtensor_ops.install()
    layout = load_layout(layout)
    if getattr(model, "_meshlm_state", None) is not None:
        raise MeshlmError("this model is already sharded; build a fresh model to shard it again")
    plans = plan_params(model, layout, mesh)
    _check_layout_axes(layout, mesh)
    _materialize(model, plans, mesh, seed if init else None, param_dtype, grad_dtype)
    if reduce_dtype is None:
        reduce_dtype = precision.default_reduce_dtype(compute_dtype, [p.dtype for p in model.parameters()])
    st = ShardState(layout, mesh, plans, compute_dtype, reduce_dtype, grad_dtype, vocab=frozenset(vocabulary(model)))
    st.overlap = mesh.device_type == "cuda" if overlap is None else bool(overlap)
    by_module: dict[int, tuple[nn.Module, dict[str, _UseSpec]]] = {}
    for fqn, m, name, _p in iter_params(model):
        pp = plans[fqn]
        use = _UseSpec(placements(pp.compute, mesh), None if pp.grads is None else placements(pp.grads, mesh),
                       regather=_needs_regather(pp))
        use.key = _at_use_key(use.compute, use.grads, compute_dtype, reduce_dtype, use.regather, grad_dtype)
        by_module.setdefault(id(m), (m, {}))[1][name] = use
    tied: dict[int, dict[str, tuple[nn.Module, str]]] = {}  # NOTE [ties] in ties.py: read through the first slot
    for m, name, first, first_name in ties.aliases(model):
        by_module.setdefault(id(m), (m, {}))
        tied.setdefault(id(m), {})[name] = (first, first_name)
    for m, uses in by_module.values():
        m._meshlm_tied = tied.get(id(m), {})
        m.__class__ = _sharded_class(type(m), tuple(uses), False, tuple(m._meshlm_tied))
        m._meshlm_use = uses
        m._meshlm_now = {}
        m._meshlm_state = st
    for m in _outer_blocks(model):
        spec = _block_spec(m, st, bucket)
        if spec.key is None and not spec.regather:
            continue
        cls = type(m)
        base = cls.__mro__[1] if cls in _CLASSES.values() else cls
        m.__class__ = _sharded_class(base, tuple(getattr(m, "_meshlm_use", {})), True,
                                     tuple(getattr(m, "_meshlm_tied", {})))
        m._meshlm_block = spec
        if spec.regather and spec.key is not None:
            _allow_conduit_under_checkpoint()
    _link_blocks(model)
    from meshlm import root

    st.root = root.root_spec(model, st) if bucket else None
    root_cls = type(model)
    model._meshlm_orig_forward = root_cls.forward
    model.__class__ = type(root_cls.__name__, (root_cls,), {"forward": root.root_forward,
                                                            "__module__": root_cls.__module__})
    model._meshlm_state = st
    return model


_CLASSES: dict[tuple[type, tuple[str, ...], bool, tuple[str, ...]], type] = {}


def _link_blocks(model: nn.Module) -> None:
    """Tell the buckets the blocks' forward order (NOTE [prefetch] in bucket.py)."""
    keyed = [blk for blk in _outer_blocks(model) if getattr(blk, "_meshlm_block", None) is not None
             and blk._meshlm_block.key is not None]
    bucket.link([blk._meshlm_block.key for blk in keyed], [_stored_params(blk) for blk in keyed])


def _stored_params(blk: nn.Module):
    spec: _BlockSpec = blk._meshlm_block
    return lambda: [_submodule(blk, path)._parameters[n] for path, n in spec.entries]


def _submodule(m: nn.Module, path: str) -> nn.Module:
    """``m.get_submodule(path)`` by plain attribute access (what torch.compile traces best:
    every layer of a block class then shares one compiled graph)."""
    if path:
        for part in path.split("."):
            m = getattr(m, part)
    return m


# One _BlockSpec object per distinct content, shared by every layer of a block class, so the
# compiled graph of a block does not specialise on which layer it runs.
_SPECS: dict[_BlockSpec, _BlockSpec] = {}


def _outer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks not nested in another block, in module order."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not is_block(m):
            continue
        out.append(m)
        inside.update(id(s) for s in m.modules())
    return out


def _block_spec(blk: nn.Module, st: ShardState, use_bucket: bool = True) -> _BlockSpec:
    """Bucket every parameter of ``blk`` whose move to compute is a gather over data axes
    (NOTE [block buckets]); decide whether the block may run on local tensors."""
    names = st.names
    data_dims = tuple(i for i, n in enumerate(names) if n in DATA_AXES)
    entries, members, regather = [], [], False
    pure = _pure_data_parallel(st.layout, st.sizes)
    for path, sub in blk.named_modules():
        for name, use in getattr(sub, "_meshlm_use", {}).items():
            regather |= use.regather
            p = sub._parameters[name]
            mem = bucket.member(p.placements, use.compute, use.grads, tuple(p.shape), p.dtype, data_dims)
            if mem is not None and (data_dims or pure) and use_bucket:
                entries.append((path, name))
                members.append(mem)
    if not entries:
        spec = _BlockSpec(None, (), regather, False)
        return _SPECS.setdefault(spec, spec)
    local = pure and all(_whole_in_compute(mem, st) for mem in members)
    rows = (rng.rank_index(st.coord, [st.sizes[n] for n in st.names]), st.mesh.size()) if local else None
    spec = _BlockSpec(_register_bucket(st, members, local), tuple(entries), regather, local, rows)
    return _SPECS.setdefault(spec, spec)


def _whole_in_compute(mem: bucket.Member, st: ShardState) -> bool:
    """The parameter is whole on every rank in compute (so it may be used on local rows)."""
    return all(isinstance(pl, Replicate) or n == 1 for pl, n in zip(mem.compute, (st.sizes[a] for a in st.names)))


def _register_bucket(st: ShardState, members: Sequence[bucket.Member], local: bool) -> int:
    """The index of the bucket of ``members`` on the model's mesh (NOTE [block buckets])."""
    mesh, names = st.mesh, st.names
    return bucket.register(bucket.Bucket(mesh, tuple(mesh.get_group(i).group_name for i in range(len(names))),
                                         tuple(st.sizes[n] for n in names),
                                         tuple(i for i, n in enumerate(names) if n in DATA_AXES), tuple(members),
                                         st.compute_dtype, st.reduce_dtype, local, st.overlap, st.grad_dtype))


def _allow_conduit_under_checkpoint() -> None:
    """A bucketed block hands its gathered parameters to the parameter getters through
    ``module._meshlm_now``, a dict written and cleared inside the block's forward.  Under
    torch.compile that write sits inside the checkpointed (re-gathering) region, which
    Dynamo refuses by default because eager checkpointing would replay Python side effects
    in backward.  Here the dict is only a conduit within one trace (written, read, cleared),
    and the recompute is the traced graph's, so not replaying it is exactly right."""
    cfg = torch._dynamo.config
    if hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _pure_data_parallel(layout: Layout, sizes: Mapping[str, int]) -> bool:
    """Compute is data parallelism only on this mesh: every mesh axis (of size > 1) splits
    ``batch`` and no other logical axis (NOTE [local blocks] in bucket.py)."""
    names = {a for a, n in sizes.items() if n > 1}
    if not names:
        return True  # one device: every block's math is the one-device math
    if not names <= set(DATA_AXES):
        return False
    for axis, mesh_axes in layout.compute.items():
        present = {a for a in mesh_axes if a in names}
        if axis == "batch" and present != names:
            return False
        if axis != "batch" and present:
            return False
    return True


def _needs_regather(pp: ParamPlan) -> bool:
    """Gathered over a data axis at use (ZeRO-3): storage shards a dim over dp/fsdp that
    compute does not."""
    for st_axes, cp_axes in zip(pp.storage, pp.compute):
        if any(a in DATA_AXES and a not in cp_axes for a in st_axes):
            return True
    return False


def _sharded_class(cls: type, names: tuple[str, ...], block: bool, tied: tuple[str, ...] = ()) -> type:
    """One subclass per (class, parameter names), shared by every instance, so that
    torch.compile sees the same type for every layer and compiles a block once.  ``tied``:
    attributes that read through another module's (NOTE [ties] in ties.py)."""
    key = (cls, names, block, tied)
    if key not in _CLASSES:
        attrs = {n: _make_getter(n) for n in names}
        attrs.update({n: _tied_getter(n) for n in tied})
        if block:
            attrs["forward"] = _block_forward
        attrs["__module__"] = cls.__module__
        attrs["__qualname__"] = cls.__qualname__
        _CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _CLASSES[key]


def _check_layout_axes(layout: Layout, mesh: DeviceMesh) -> None:
    names = set(mesh.mesh_dim_names or ())
    spec = mesh_spec(mesh).as_dict()
    for a in layout.mesh_axes_used():
        if a in spec and spec[a] > 1 and a not in names:
            raise LayoutError(f"{layout.source}: mesh axis {a!r} is not a dim of this DeviceMesh")


def _materialize(model: nn.Module, plans: dict[str, ParamPlan], mesh: DeviceMesh, seed: Optional[int],
                 param_dtype: Optional[torch.dtype] = None, master_dtype: Optional[torch.dtype] = None) -> None:
    """Each rank's shards.  With a ``master_dtype`` other than the storage dtype (main
    gradients, NOTE [main grads] in main_grad.py), each parameter also gets this rank's
    optimizer-placement block of its initial weights in ``master_dtype``, before they are
    rounded to the storage dtype (``main_grad.INIT_MASTER``), which ``ShardedOptimizer``
    takes as the master: a bf16-stored model keeps its float32 initialisation."""
    dev = torch.device(mesh.device_type)
    owner: dict[int, str] = {}
    for fqn, _m, _n, p in iter_params(model):
        owner[id(p)] = fqn
    every = set(owner)
    first: dict[int, tuple[nn.Module, str]] = {}  # NOTE [ties] in ties.py: each parameter's first slot
    any_meta = any(p.is_meta for p in model.parameters())
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    for mname, m in model.named_modules():
        # every slot draws (the stream does not depend on ties); its first slot's draw is kept
        own = [(n, p) for n, p in m._parameters.items() if p is not None and id(p) in every]
        direct = [(n, p) for n, p in own if id(p) in owner]
        fulls = annotate.init_module(m, gen, own) if any_meta and seed is not None else {}
        for n, p in direct:
            fqn = owner.pop(id(p))
            first[id(p)] = (m, n)
            if p.is_meta and seed is None:  # uninitialised: allocate this rank's shard only
                pl = placements(plans[fqn].storage, mesh)
                local = torch.empty(plans[fqn].local_shape(plans[fqn].storage, mesh_spec(mesh).as_dict()),
                                    dtype=param_dtype or p.dtype, device=dev)
                dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(plans[fqn].shape),
                                        stride=torch.empty(plans[fqn].shape, device="meta").stride())
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
            dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(plans[fqn].shape),
                                    stride=stride)
            m._parameters[n] = nn.Parameter(dt, requires_grad=p.requires_grad)
            if master_dtype is not None and master_dtype != local.dtype and p.requires_grad:
                opl = placements(plans[fqn].optimizer, mesh)
                init = local_slice(src, mesh, opl).to(dev, dtype=master_dtype).clone().contiguous()
                setattr(m._parameters[n], main_grad.INIT_MASTER,
                        DTensor.from_local(init, mesh, opl, run_check=False, shape=torch.Size(plans[fqn].shape),
                                           stride=stride))
    for m in model.modules():  # a tied parameter's other slots hold the one sharded Parameter
        for n, p in m._parameters.items():
            if p is not None and id(p) in first and first[id(p)] != (m, n):
                f, fn = first[id(p)]
                m._parameters[n] = f._parameters[fn]
    _check_no_shared_params(model)


def _check_no_shared_params(model: nn.Module) -> None:
    """Every slot holds a sharded parameter: none was left with the unsharded tensor."""
    for mname, m in model.named_modules(remove_duplicate=False):
        for n, p in m._parameters.items():
            if isinstance(p, nn.Parameter) and not isinstance(p.data, DTensor):
                raise MeshlmError(f"internal error: parameter `{mname}.{n}` was left unsharded by meshlm.shard "
                                  "(a slot of a tied parameter, NOTE [ties] in meshlm/ties.py, not re-pointed)")


# --------------------------------------------------------------------------- helpers
def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter gathered to a full plain tensor (every rank gets all; small models)."""
    return {fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for fqn, _m, _n, p in iter_params(model)}
