"""Per-block flat collectives: one all-gather and one reduce per block, not per parameter.

NOTE [block buckets]
    A block's parameters are gathered at the block's entry in one flat collective per data
    mesh axis (the local shards concatenated into one buffer, all-gathered, and cut back into
    tensors), and their gradients are reduced the same way in backward: one flat
    reduce-scatter (or all-reduce) per data mesh axis for the whole block.  The bytes are
    those of the per-parameter collectives; the count drops from one per parameter to one per
    block and axis (FSDP2's and DDP's bucketing, at block granularity).

    Only the data axes (``dp``, ``fsdp``) are bucketed.  Other mesh axes (``tp``, ...) must
    be placed the same in storage and compute; a gradient that arrives Partial over them (the
    norm weights under sequence parallelism) is reduced per parameter after the data-axis
    reduce-scatter, so on the scattered shard.  A parameter whose storage -> compute move is
    anything else is left to the per-parameter path (``lower._AtUse``).

    Several data axes on one tensor dim (``embed: [dp, fsdp]``) are gathered inner axis
    first and reduce-scattered outer axis first, which keeps NOTE [shard order].

NOTE [local blocks]
    When the layout's compute is pure data parallelism on this mesh (every mesh axis splits
    the batch and nothing else, so every parameter is replicated in compute), a block's
    math on each rank is exactly the one-device block on that rank's rows.  Such a block runs
    on plain local tensors (FSDP2's and DDP's way): its batch-sharded DTensor inputs are
    unwrapped, the gathered parameters are plain tensors, and the outputs are wrapped back as
    batch-sharded.  That removes DTensor's per-op dispatch from the block (the bulk of the
    step's CPU overhead) while the collectives stay the same.  The gradient of a parameter
    used on local rows is this rank's share of a sum over all ranks, i.e. Partial over every
    mesh axis, which is what the bucket's backward reduces.  A block whose inputs are not all
    batch-sharded at run time falls back to DTensor compute.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshlm import _dtensor_ops, main_grad
from meshlm.memory import where

# torch 2.13 renamed funcol.reduce_scatter_tensor (now a deprecated alias that warns on
# every eager call) to reduce_scatter_single; both issue the same _c10d_functional op.
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@dataclass(frozen=True)
class Member:
    """One parameter of a bucket: its placements, shapes and which data axes move it."""

    storage: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    grads: Optional[tuple[Placement, ...]]  # None: left Partial (ZeRO-1)
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]
    dtype: torch.dtype
    gather: tuple[tuple[int, int], ...]  # (mesh dim, tensor dim), inner mesh dim first


@dataclass(frozen=True)
class Bucket:
    """Everything a block's gather and reduce need, fixed at lowering time."""

    mesh: DeviceMesh
    groups: tuple[str, ...]  # process-group name per mesh dim
    sizes: tuple[int, ...]
    data_dims: tuple[int, ...]  # mesh dims that are data axes, outer -> inner
    members: tuple[Member, ...]
    compute_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    local: bool  # NOTE [local blocks]: may run on plain local tensors
    overlap: bool = False  # NOTE [overlapped reduction]
    grad_dtype: Optional[torch.dtype] = None  # NOTE [main grads] in main_grad.py: where it differs from a member's


# Buckets are referred to by index from traced code (an int is a constant to torch.compile).
_BUCKETS: list[Bucket] = []


def register(bucket: Bucket) -> int:
    """The index of ``bucket``; equal buckets (every layer of a block class) share one, so
    that a compiled block graph does not specialise on the layer.  Equal meshes (another
    model on the same ranks) share one too: DTensor's sharding-propagation cache already
    hands one model's DTensors the mesh object of another model's equal mesh, and a bucket
    on a third object would make compiled blocks see two meshes and compile twice."""
    for k, b in enumerate(_BUCKETS):
        if b == bucket:
            return k
    _BUCKETS.append(bucket)
    return len(_BUCKETS) - 1


def member(storage: Sequence[Placement], compute: Sequence[Placement], grads: Optional[Sequence[Placement]],
           shape: Sequence[int], dtype: torch.dtype, data_dims: Sequence[int]) -> Optional[Member]:
    """The bucket member for one parameter, or None if its storage -> compute move is not a
    pure gather over data axes (then the per-parameter path handles it)."""
    gather = []
    for i, (s, c) in enumerate(zip(storage, compute)):
        if s == c:
            continue
        if i in data_dims and isinstance(s, Shard) and isinstance(c, Replicate):
            gather.append((i, s.dim))
            continue
        return None
    stride = tuple(torch.empty(tuple(shape), device="meta").stride())
    return Member(tuple(storage), tuple(compute), None if grads is None else tuple(grads), tuple(shape), stride,
                  dtype, tuple(sorted(gather, key=lambda t: -t[0])))


# --------------------------------------------------------------------------- flat collectives
# torch 2.13 renamed all_gather_tensor to all_gather_single (2.11 has only the old name).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: Tensor) -> Tensor:
    """Wait for an eager functional collective now (a no-op in traced code, where the wait
    is already in the graph): inside the gather, so that re-gathering recomputes the wait
    too, and before gradients are stored, so that ``.grad`` holds a plain tensor."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _issue_gather(xs: list[Tensor], group: str) -> Tensor:
    flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1)
    return _all_gather(flat, 0, group)


def _gather_flat(xs: list[Tensor], dims: list[int], group: str, n: int, issued: Optional[Tensor] = None,
                 into: Optional[list[Optional[Tensor]]] = None) -> list[Tensor]:
    """All-gather each of ``xs`` along its ``dims[j]`` over ``group`` (n ranks), in one
    collective: every rank's block lands at its rank's offset along that dim.  ``issued``:
    that collective, already in flight (NOTE [prefetch]).  ``into[j]``: a contiguous tensor
    of the gathered shape to write result j into (no intermediate copy), or None."""
    out = _wait(issued if issued is not None else _issue_gather(xs, group)).view(n, -1)
    # In eager mode, when some tensor must be reordered (gathered along a dim other than the
    # first: a copy), every tensor is copied out, so that no view keeps the collective's
    # buffer alive beside the copies (that held a block's gathered parameters twice).
    own = _eager() and len(xs) > 1 and any(dims)
    res, off = [], 0
    for j, (x, d) in enumerate(zip(xs, dims)):
        k = x.numel()
        shape = tuple(x.shape[:d]) + (n * x.shape[d],) + tuple(x.shape[d + 1:])
        piece = out[:, off:off + k].view((n,) + tuple(x.shape))  # rank r's block at [r]
        dst = into[j] if into is not None else None
        if dst is None and own:
            dst = torch.empty(shape, dtype=out.dtype, device=out.device)
        if dst is not None:
            dst.view(tuple(x.shape[:d]) + (n, x.shape[d]) + tuple(x.shape[d + 1:])).movedim(d, 0).copy_(piece)
            res.append(dst)
        else:
            res.append((piece.movedim(0, d) if d else piece).reshape(shape))
        off += k
    return res


def _pack(gs: list[Tensor], dims: Optional[list[int]], n: int, dtype: Optional[torch.dtype]) -> tuple[Tensor, bool]:
    """(The flat buffer a reduce collective sends: ``gs`` concatenated (``dims`` None: an
    all-reduce), or, for a reduce-scatter, rank r's block of every tensor along its
    ``dims[j]`` at row r, in ``dtype`` (default: the tensors' own); whether it is a buffer
    of our own, made here in eager mode, that nothing else reads).

    NOTE [reduce in place of the casts]
        In eager mode each gradient is cast and reordered straight into its slot of one
        buffer made for the collective (one ``copy_`` per gradient), so a block's gradient
        reduction holds, besides the gradients autograd hands it, only that buffer and the
        collective's result: no float32 cast of each gradient, no reordered copy of it and
        no second, concatenated copy (what ``.to``, ``reshape`` and ``cat`` made before,
        12 bytes per element of the block over the 4 of the buffer;
        benchmarks/memory_floor.py).  FSDP2 packs its reduce-scatter input the same way.
        Traced code keeps the functional form (cast, ``reshape``, ``cat``): the compiler
        plans those buffers itself, and in-place writes into slices would be functionalized
        into whole-buffer copies."""
    dtype = dtype or gs[0].dtype
    if not _eager():
        if any(g.dtype != dtype for g in gs):
            gs = [g.to(dtype) for g in gs]
        if dims is None:
            return (torch.cat([g.reshape(-1) for g in gs]) if len(gs) > 1 else gs[0].reshape(-1)), False
        rows = []
        for g, d in zip(gs, dims):
            s = tuple(g.shape)
            rows.append(g.reshape(s[:d] + (n, s[d] // n) + s[d + 1:]).movedim(d, 0).reshape(n, -1))
        return (torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1)), False
    if len(gs) == 1 and gs[0].dtype == dtype and gs[0].is_contiguous() and (dims is None or dims[0] == 0):
        return gs[0].reshape(-1), False  # already laid out as the collective wants: no copy
    total = sum(g.numel() for g in gs)
    flat = torch.empty(total, dtype=dtype, device=gs[0].device)
    off = 0
    for j, g in enumerate(gs):
        s, k = tuple(g.shape), g.numel()
        if dims is None:
            flat[off:off + k].view(s).copy_(g)
        else:
            d = dims[j]
            m = s[d] // n
            dst = flat.view(n, total // n)[:, off // n:(off + k) // n].view((n,) + s[:d] + (m,) + s[d + 1:])
            dst.copy_(g.reshape(s[:d] + (n, m) + s[d + 1:]).movedim(d, 0))
        off += k
    return flat, True


def _reduce_scatter_flat(gs: list[Tensor], dims: list[int], group: str, n: int, wait: bool = True,
                         dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    """Sum over ``group`` and keep this rank's 1/n block of each tensor along its dim, in one
    collective (the inverse layout of ``_gather_flat``), in ``dtype`` (default: the
    tensors' own; NOTE [reduce in place of the casts])."""
    shapes = []
    for g, d in zip(gs, dims):
        s = tuple(g.shape)
        shapes.append(s[:d] + (s[d] // n,) + s[d + 1:])
    out = _REDUCE_SCATTER(_pack(gs, dims, n, dtype)[0], "sum", 0, group)
    out = _wait(out) if wait else out
    return _split(out, shapes)


def _all_reduce_flat(gs: list[Tensor], group: str, wait: bool = True, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    shapes = [tuple(g.shape) for g in gs]
    flat, own = _pack(gs, None, 1, dtype)
    if own:
        # The packed buffer is a fresh buffer of our own: reduce it in place.  funcol's
        # all_reduce would allocate and fill a second buffer of the same size; on 4 gloo
        # ranks of a 2-core machine, four 2.9 MB all-reduces took 50 ms out of place against
        # 39 ms in place (benchmarks/gloo_collectives.py).  Traced code keeps the
        # functional op (the compiler plans its buffers).
        return _split(_all_reduce_inplace(flat, group, wait), shapes)
    out = funcol.all_reduce(flat, "sum", group)
    out = _wait(out) if wait else out
    return _split(out, shapes)


def _all_reduce_inplace(flat: Tensor, group: str, wait: bool) -> Tensor:
    """Sum ``flat`` over ``group`` in place (eager only); ``wait=False``: left in flight as
    an AsyncCollectiveTensor."""
    out = torch.ops._c10d_functional.all_reduce_(flat, "sum", group)
    return torch.ops._c10d_functional.wait_tensor(out) if wait else funcol._maybe_wrap_tensor(out)


def _split(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    res, off = [], 0
    for s in shapes:
        k = 1
        for v in s:
            k *= v
        res.append(flat[off:off + k].view(s))
        off += k
    return res


def _by_dtype(idx: list[int], xs: list[Tensor]) -> list[list[int]]:
    """Indices grouped by dtype (one flat buffer has one dtype)."""
    return _groups(idx, xs, {})


def _groups(idx: list[int], xs: list[Tensor], key: dict, dtype: Optional[torch.dtype] = None) -> list[list[int]]:
    """Indices grouped by dtype (``dtype``, where given, for all) and ``key[j]``."""
    out: dict[tuple, list[int]] = {}
    for j in idx:
        out.setdefault((dtype or xs[j].dtype, key.get(j)), []).append(j)
    return list(out.values())


def _flat_moves(xs: list, pls: list, tg: list, sizes: Sequence[int], groups: Sequence[str],
                order: Sequence[tuple[str, int]], key: Optional[dict] = None, wait: bool = True,
                into: Optional[dict] = None, dtype: Optional[torch.dtype] = None) -> None:
    """Move local tensors ``xs[j]`` (None: skipped), placed ``pls[j]``, toward ``tg[j]`` with
    flat collectives, in place on ``xs`` and ``pls``.  For each (kind, mesh dim) of
    ``order``, kind "rs" (Partial -> Shard), "ar" (Partial -> Replicate) or "ag" (Shard ->
    Replicate): one collective for each group of the tensors that make that move and share
    their dtype and ``key[j]``.  ``into[j]``: where tensor j's last move, an all-gather, is
    written (``_gather_flat``).  ``dtype``: the dtype the reductions ("rs", "ar") sum in,
    each tensor cast as it is packed into the collective's buffer (NOTE [reduce in place of
    the casts]).  Moves not in ``order`` are left to the caller."""
    key = key or {}
    live = [j for j in range(len(xs)) if xs[j] is not None]
    for kind, i in order:
        if kind == "ag":
            idx = [j for j in live if isinstance(pls[j][i], Shard) and isinstance(tg[j][i], Replicate)]
        else:
            want = Shard if kind == "rs" else Replicate
            idx = [j for j in live if _partial(pls[j][i]) and isinstance(tg[j][i], want)]
        for grp in _groups(idx, xs, key, dtype if kind != "ag" else None):
            part = [xs[j] for j in grp]
            if kind == "rs":
                ys = _reduce_scatter_flat(part, [tg[j][i].dim for j in grp], groups[i], sizes[i], wait, dtype)
            elif kind == "ar":
                ys = _all_reduce_flat(part, groups[i], wait, dtype)
            else:
                last = [into is not None and j in into and all(pls[j][k] == tg[j][k] for k in range(len(sizes)) if k != i)
                        for j in grp]
                ys = _gather_flat(part, [pls[j][i].dim for j in grp], groups[i], sizes[i],
                                  into=[into[j] if ok else None for j, ok in zip(grp, last)])
            for j, y in zip(grp, ys):
                xs[j], pls[j][i] = y, tg[j][i]


def _target(m: Member, pls: list) -> tuple[Placement, ...]:
    """Where a gradient ends: the layout's ``grads``, or for local grads (ZeRO-1) Partial
    where it is Partial and the storage placement elsewhere."""
    if m.grads is not None:
        return m.grads
    return tuple(pl if pl.is_partial() else sp for pl, sp in zip(pls, m.storage))


# --------------------------------------------------------------------------- prefetch
# NOTE [prefetch]
#     With ``overlap`` in eager mode, a bucket that has issued its own gather issues the
#     first gather of the block that runs next (the next block in forward, the previous one
#     when backward re-gathers blocks), so that it is in flight during this block's compute;
#     that block then consumes it instead of gathering.  Only the first (innermost) gather
#     step is prefetched; a prefetch is used only if the shards it read are unchanged
#     (same storage and version), and a stale one is waited for and dropped.  Every rank
#     runs the same code, so the collectives keep one order on every rank.  Local blocks only
#     (NOTE [local blocks]): they re-gather by freeing (NOTE [free and re-gather]) or by a
#     plain recompute, whereas the selective checkpointing that DTensor blocks may run under
#     matches ops by their count, and a prefetch issued inside one block's region (forward:
#     the next block's; recompute: the previous one's) would shift it.
# Blocks are named by the id of their first stored parameter (buckets are shared by layers).
_ORDER: dict[int, tuple] = {}  # block -> ((key, params) of the next block or None, of the previous or None)
_PREFETCHED: dict[int, tuple[tuple, list[Tensor]]] = {}  # block -> (stamp of the shards, flats in flight)
PREFETCH_STATS = {"issued": 0, "used": 0, "stale": 0}


def link(keys: Sequence[int], params: Sequence[Callable[[], list]]) -> None:
    """Record the blocks' order (forward order) for prefetching: ``keys[n]`` is block n's
    bucket, ``params[n]()`` its stored parameters in member order."""
    blocks = list(zip(keys, params))
    for n, (_k, get) in enumerate(blocks):
        _ORDER[id(get()[0])] = (blocks[n + 1] if n + 1 < len(blocks) else None, blocks[n - 1] if n else None)


# NOTE [fake eager]: a fake tensor mode usually means torch.compile is tracing, but
# meshlm.plan's measurement (NOTE [fake measurement] in meshlm/plan/measure.py) runs the
# eager step on fake tensors and must take the eager paths (free and re-gather, prefetch,
# the local root) exactly as a real run does.
FAKE_IS_EAGER: contextvars.ContextVar[bool] = contextvars.ContextVar("meshlm_fake_is_eager", default=False)


def _eager() -> bool:
    if torch.compiler.is_compiling():
        return False
    return torch._guards.detect_fake_mode() is None or FAKE_IS_EAGER.get()


def _stamp(params) -> tuple:
    return tuple((where(p._local_tensor), p._local_tensor._version) for p in params)


def _compute_locals(b: Bucket, params) -> list[Tensor]:
    xs = [p._local_tensor for p in params]
    if b.compute_dtype is not None:
        xs = [x if x.dtype == b.compute_dtype else x.to(b.compute_dtype) for x in xs]
    return xs


def _gather_steps(b: Bucket, xs: list[Tensor]) -> list[tuple[int, list[list[int]]]]:
    """(mesh dim, member groups of one flat buffer each) per gather step, inner dim first."""
    out = []
    for i in sorted({i for m in b.members for i, _ in m.gather if b.sizes[i] > 1}, reverse=True):
        idx = [j for j, m in enumerate(b.members) if any(mi == i for mi, _ in m.gather)]
        out.append((i, _by_dtype(idx, xs)))
    return out


def _take_prefetched(params) -> Optional[list[Tensor]]:
    got = _PREFETCHED.pop(id(params[0]), None)
    if got is None:
        return None
    stamp, flats = got
    if stamp != _stamp(params):
        for f in flats:
            _wait(f)
        PREFETCH_STATS["stale"] += 1
        return None
    PREFETCH_STATS["used"] += 1
    return flats


def _prefetch_neighbour(params) -> None:
    in_backward = torch._C._current_graph_task_id() != -1
    nxt = _ORDER.get(id(params[0]), (None, None))[1 if in_backward else 0]
    if nxt is None:
        return
    key, get = nxt
    params = get()
    if id(params[0]) in _PREFETCHED:
        return
    b = _BUCKETS[key]
    with torch.no_grad():
        xs = _compute_locals(b, params)
        steps = _gather_steps(b, xs)
        if steps:
            i, groups = steps[0]
            _PREFETCHED[id(params[0])] = (_stamp(params), [_issue_gather([xs[j] for j in grp], b.groups[i])
                                                           for grp in groups])
            PREFETCH_STATS["issued"] += 1


def _gather_locals(b: Bucket, params, prefetch: bool) -> list[Tensor]:
    """The local tensors of the block's parameters in compute placements (gathered over the
    data axes), using and issuing prefetches when ``prefetch`` (NOTE [prefetch])."""
    pre = _take_prefetched(params) if prefetch else None
    xs = _compute_locals(b, params)
    for n_step, (i, groups) in enumerate(_gather_steps(b, xs)):
        for g, grp in enumerate(groups):
            dims = [dict(b.members[j].gather)[i] for j in grp]
            issued = pre[g] if pre is not None and n_step == 0 else None
            for j, y in zip(grp, _gather_flat([xs[j] for j in grp], dims, b.groups[i], b.sizes[i], issued)):
                xs[j] = y
        if n_step == 0 and prefetch:
            _prefetch_neighbour(params)
    return xs


# --------------------------------------------------------------------------- free and re-gather
# NOTE [free and re-gather]
#     ZeRO-3 must not keep a block's gathered parameters from forward to backward, yet
#     autograd saves them (F.linear keeps its weight).  In eager mode a re-gathering block
#     does what FSDP2 does: when the block's forward returns, the storage of every gathered
#     tensor is freed (resized to 0 bytes; autograd's saved tensors are views of it and stay
#     valid objects), and the block's outputs pass through an identity autograd node
#     (``_Regather``) whose backward, which runs before any of the block's own backward
#     nodes, re-allocates those storages and all-gathers the parameters into them again.
#     Nothing is recomputed, and backward moves the same bytes as the re-gather by
#     checkpointing did.  When the block's backward is done (its gather's backward node has
#     run) the storages are freed again (``free_after_backward``), so backward, like forward,
#     holds one block's gathered parameters at a time (two with a prefetch in flight).
#     Under torch.compile (storage resizing does not trace) blocks
#     re-gather by checkpointing instead (NOTE [re-gather in backward] in lower.py), and under
#     train's activation checkpointing by that checkpoint's recompute.
class Freed:
    """The gathered tensors of one forward of one block, freed after it (NOTE [free and
    re-gather])."""

    def __init__(self, key: int, params, xs: Sequence[Tensor], local: bool):
        self.key, self.params, self.local = key, tuple(params), local
        own = {p._local_tensor.untyped_storage()._cdata for p in params}  # storages, NOTE [fake eager]
        self.slots: dict[int, tuple[torch.UntypedStorage, int, list]] = {}
        for j, x in enumerate(xs):
            st = x.untyped_storage()
            if st._cdata in own or st.nbytes() == 0:  # a stored shard itself: never freed
                continue
            self.slots.setdefault(st._cdata, (st, st.nbytes(), []))[2].append((j, x))
        self.freed = False

    def free(self) -> None:
        for st, _n, _xs in self.slots.values():
            st.resize_(0)
        self.freed = True

    def regather(self) -> None:
        if not self.freed:
            return
        self.freed = False
        b = _BUCKETS[self.key]
        _GATHERING[0] += 1
        try:
            with torch.no_grad():
                ys = _gather_locals(b, self.params, prefetch=b.overlap and self.local and _eager())
                for st, n, xs in self.slots.values():
                    st.resize_(n)
                    for j, x in xs:
                        with torch.autograd._unsafe_preserve_version_counter(x):
                            x.copy_(ys[j])
        finally:
            _GATHERING[0] -= 1


class _Regather(torch.autograd.Function):
    """Identity on a block's outputs; its backward re-gathers the block's freed parameters."""

    @staticmethod
    def forward(ctx, freed: Freed, *outs):  # type: ignore[override]
        ctx.freed = freed
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.freed.regather()
        return (None, *grads)


def free_after_backward(freed: Freed, gathered) -> None:
    """Free the block's re-gathered tensors again once the block's backward is done: a hook
    on the node of its gather (``_Gather``), which runs last in the block's backward (NOTE
    [free and re-gather]).  Without it every block's re-gathered parameters stayed alive
    until the end of backward (autograd's saved views keep the storages), so a ZeRO-3
    backward peaked at all of them at once, ZeRO-2's memory (found by
    benchmarks/memory_floor.py on 4 blocks)."""
    node = getattr(gathered[0], "grad_fn", None) if len(gathered) else None
    if node is not None and freed.slots:
        node.register_hook(lambda _grad_inputs, _grad_outputs: freed.free())


def free_after(freed: Freed, out):
    """Free the block's gathered tensors and route ``out`` (a tensor or a tuple/list of
    them) through ``_Regather``."""
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    idx = [k for k, o in enumerate(flat) if isinstance(o, Tensor) and o.requires_grad]
    if not idx or not freed.slots:
        return out
    for k, o in zip(idx, _Regather.apply(freed, *[flat[k] for k in idx])):
        flat[k] = o
    freed.free()
    return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]


# --------------------------------------------------------------------------- the autograd op
_GATHERING = [0]  # > 0 while a bucket gathers (lower._regather_policy recomputes those ops)


class _Gather(torch.autograd.Function):
    """Forward: the block's stored parameters -> compute (plain local tensors for a local
    block).  Backward: their gradients -> the layout's ``grads`` placements."""

    @staticmethod
    def forward(ctx, key: int, local: bool, *params):  # type: ignore[override]
        b = _BUCKETS[key]
        ctx.key, ctx.local, ctx.params = key, local, params
        _GATHERING[0] += 1
        try:
            xs = _gather_locals(b, params, prefetch=b.overlap and local and _eager())
            out = []
            for x, p, m in zip(xs, params, b.members):
                if x is p._local_tensor:  # nothing moved: a fresh alias, not the stored tensor
                    x = x.view_as(x)
                out.append(x if local else _dtensor_ops.wrap(x, b.mesh, m.compute, m.shape, m.stride))
            return tuple(out)
        finally:
            _GATHERING[0] -= 1

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        b = _BUCKETS[ctx.key]
        n = len(b.members)
        xs: list = [None] * n
        pls: list = [None] * n
        for j, g in enumerate(grads):
            if g is None:
                continue
            if ctx.local:  # NOTE [local blocks]: this rank's share of a sum over every mesh axis
                m = b.members[j]
                xs[j], pls[j] = g, [_SUM if n > 1 else (m.grads or m.storage)[i] for i, n in enumerate(b.sizes)]
            else:
                xs[j], pls[j] = g.to_local(), list(g.placements)
        live = [j for j in range(n) if xs[j] is not None]
        targets = {j: _target(b.members[j], pls[j]) for j in live}
        # Which flat collectives each gradient goes through; gradients with the same route
        # share their buffers, so a buffer is freed as a whole (none outlives its last use).
        route = {j: tuple((i, type(targets[j][i]).__name__) for i in range(len(b.sizes))
                          if _partial(pls[j][i]) and not targets[j][i].is_partial()) for j in live}
        other = tuple(i for i in range(len(b.sizes)) if i not in b.data_dims)
        # Reduce-scatters over data axes, outer axis first; then all-reduces on the scattered
        # shards (HSDP all-reduces 1/fsdp of the gradient over dp); then the other axes (the
        # norm weights' tp reduction under sequence parallelism), again on the shards.
        order = [(k, i) for dims_ in (b.data_dims, other) for k in ("rs", "ar") for i in dims_]
        tg = [targets.get(j) for j in range(n)]
        # The reductions sum in the reduce dtype, each gradient cast as it is packed (NOTE
        # [reduce in place of the casts]); one that no flat collective moved is cast here.
        _flat_moves(xs, pls, tg, b.sizes, b.groups, order, key=route, wait=not b.overlap, dtype=b.reduce_dtype)
        out: list = [None] * n
        for j in live:
            m = b.members[j]
            if b.reduce_dtype is not None and xs[j].dtype != b.reduce_dtype:
                xs[j] = xs[j].to(b.reduce_dtype)
            gshape = list(xs[j].shape)
            for i, pl in enumerate(pls[j]):
                if isinstance(pl, Shard):
                    gshape[pl.dim] *= b.sizes[i]
            g = _dtensor_ops.wrap(xs[j], b.mesh, pls[j], gshape, m.stride)
            if tuple(g.placements) != targets[j]:  # anything else: per parameter
                g = g.redistribute(b.mesh, targets[j])
            if b.grad_dtype is not None and b.grad_dtype != m.dtype:  # NOTE [main grads]: none to autograd
                main_grad.accumulate(ctx.params[j], g, b.grad_dtype)
                continue
            if g.dtype != m.dtype:
                g = g.to(m.dtype)
            if isinstance(g._local_tensor, funcol.AsyncCollectiveTensor):
                _settle_later(ctx.params[j])
            out[j] = g
        return (None, None, *out)


# NOTE [overlapped reduction]
#     With ``overlap`` (``shard(..., overlap=True)``; the default on CUDA), in eager mode a
#     block's gradient reduction is left in flight when its backward returns (the gradient's local tensor is an AsyncCollectiveTensor), so it overlaps the
#     backward of the blocks before it, as DDP's and FSDP's reducers do.  Anything that reads
#     the gradient before then waits for it; at the end of the backward pass a callback
#     waits for every pending one and stores plain tensors in ``.grad``.  Traced code waits
#     in the graph (the compiler schedules it), so nothing is pending there.  On a CPU mesh
#     it is off by default: gloo's communication threads compete with the compute for the
#     same cores, and measured on a 2-core machine with 4 ranks (llama_small, seq 128) overlap
#     made the backward slower (ddp 0.430 s against 0.399 s; benchmarks/step_phases.py
#     --overlap both, docs/benchmarks.md).
_PENDING: list = []


def _settle_later(param) -> None:
    if not _PENDING:
        torch.autograd.Variable._execution_engine.queue_callback(_settle)
    _PENDING.append(param)


def _settle() -> None:
    pending, _PENDING[:] = list(_PENDING), []
    for p in pending:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(g._local_tensor, funcol.AsyncCollectiveTensor):
            p.grad = _dtensor_ops.wrap(g._local_tensor.wait(), g.device_mesh, g.placements, g.shape, g.stride())


def _partial(pl: Placement) -> bool:
    return pl.is_partial() and getattr(pl, "reduce_op", "sum") == "sum"


def _sum_partial():
    from torch.distributed.tensor import Partial

    return Partial("sum")


_SUM = _sum_partial()


@torch._dynamo.allow_in_graph
def gather(key: int, local: bool, *params):
    """``_Gather`` as one opaque node for Dynamo (NOTE [at-use under compile] in lower.py)."""
    return _Gather.apply(key, local, *params)


# --------------------------------------------------------------------------- local blocks
def batch_sharded(x, sizes: Sequence[int]) -> bool:
    """A DTensor split along dim 0 over every mesh dim of size > 1 (NOTE [local blocks])."""
    return isinstance(x, DTensor) and x.ndim >= 1 and len(x.placements) == len(sizes) and all(
        (isinstance(p, Shard) and p.dim == 0) if n > 1 else not p.is_partial() for p, n in zip(x.placements, sizes))


def wrap_local(x, mesh: DeviceMesh, sizes: Sequence[int], placements: Sequence[Placement]):
    """An output computed on local rows -> the batch-sharded DTensor it is (placed as the
    input rows, ``placements`` on ``mesh``, whose dim sizes are ``sizes``: plain ints, which
    traced code reads instead of the mesh)."""
    if not isinstance(x, Tensor) or isinstance(x, DTensor):
        return x
    if x.ndim == 0:
        from meshlm.errors import AnnotationError

        raise AnnotationError("a block returned a 0-d tensor while running on local rows (NOTE [local blocks] in "
                              "meshlm/bucket.py): blocks must return batch-first activations")
    world = 1
    for s, p in zip(sizes, placements):
        world *= s if isinstance(p, Shard) else 1
    shape = (x.shape[0] * world,) + tuple(x.shape[1:])
    return DTensor.from_local(x, mesh, tuple(placements), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


# --------------------------------------------------------------------------- many tensors at once
def redistribute_flat(ts: Sequence[DTensor], targets: Sequence[Sequence[Placement]], keys: Optional[Sequence] = None,
                      into: Optional[Sequence[Optional[DTensor]]] = None) -> list[DTensor]:
    """``t.redistribute(mesh, target)`` for many DTensors on one mesh, with one flat
    collective per mesh dim, kind, dtype and ``keys[j]`` (a chunk: the optimizer passes the
    block of each parameter, so no buffer is larger than a block) instead of one per tensor
    (the optimizer's ZeRO-1 reduce-scatter and ZeRO-1/2 all-gather of the update).
    Reduce-scatters go outer mesh dim first, then all-reduces, then all-gathers inner dim
    first (NOTE [shard order]); any other move is done per tensor at the end.  ``into[j]``:
    a DTensor placed as ``targets[j]`` whose local tensor receives result j in place when
    its last move is an all-gather (then it is what is returned for j)."""
    if not ts:
        return []
    mesh = ts[0].device_mesh
    sizes = tuple(mesh.size(i) for i in range(mesh.ndim))
    groups = tuple(mesh.get_group(i).group_name if sizes[i] > 1 else "" for i in range(mesh.ndim))
    tg = [tuple(x) for x in targets]
    live = [j for j in range(len(ts)) if tuple(ts[j].placements) != tg[j]]
    xs: list = [ts[j]._local_tensor if j in live else None for j in range(len(ts))]
    pls = [list(t.placements) for t in ts]
    dims = [i for i in range(mesh.ndim) if sizes[i] > 1]
    order = [("rs", i) for i in dims] + [("ar", i) for i in dims] + [("ag", i) for i in reversed(dims)]
    dst = {j: d._local_tensor for j, d in enumerate(into) if d is not None and d._local_tensor.is_contiguous()} \
        if into is not None else None
    _flat_moves(xs, pls, tg, sizes, groups, order, key=dict(enumerate(keys)) if keys is not None else None,
                into=dst)
    out = []
    for j, t in enumerate(ts):
        if j not in live:
            out.append(t)
        elif dst is not None and j in dst and xs[j] is dst[j]:
            out.append(into[j])
        else:
            d = _dtensor_ops.wrap(xs[j], mesh, pls[j], t.shape, t.stride())
            out.append(d if tuple(pls[j]) == tg[j] else d.redistribute(mesh, tg[j]))
    return out
