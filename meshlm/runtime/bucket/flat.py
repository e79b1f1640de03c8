"""Flat collectives: many local tensors moved by one collective per mesh dim and kind
(the local shards concatenated into one buffer, reduced or gathered, and cut back)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_ops
from meshlm.core.state import eager


# --------------------------------------------------------------------------- flat collectives
def waited(t: Tensor) -> Tensor:
    """Wait for an eager functional collective now (a no-op in traced code, where the wait
    is already in the graph): inside the gather, so that re-gathering recomputes the wait
    too, and before gradients are stored, so that ``.grad`` holds a plain tensor."""
    return t.wait() if compat.in_flight(t) else t


def issue_gather(xs: list[Tensor], group: str) -> Tensor:
    flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1)
    return compat.all_gather_single(flat, 0, group)


def gather_flat(
    xs: list[Tensor],
    dims: list[int],
    group: str,
    n: int,
    issued: Optional[Tensor] = None,
    into: Optional[list[Optional[Tensor]]] = None,
) -> list[Tensor]:
    """All-gather each of ``xs`` along its ``dims[j]`` over ``group`` (n ranks), in one
    collective: every rank's block lands at its rank's offset along that dim.  ``issued``:
    that collective, already in flight (NOTE [prefetch]).  ``into[j]``: a contiguous tensor
    of the gathered shape to write result j into (no intermediate copy), or None."""
    out = waited(issued if issued is not None else issue_gather(xs, group)).view(n, -1)
    # In eager mode, when some tensor must be reordered (gathered along a dim other than the
    # first: a copy), every tensor is copied out, so that no view keeps the collective's
    # buffer alive beside the copies (that held a block's gathered parameters twice).
    own = eager() and len(xs) > 1 and any(dims)
    res, off = [], 0
    for j, (x, d) in enumerate(zip(xs, dims)):
        k = x.numel()
        shape = tuple(x.shape[:d]) + (n * x.shape[d],) + tuple(x.shape[d + 1 :])
        piece = out[:, off : off + k].view((n,) + tuple(x.shape))  # rank r's block at [r]
        dst = into[j] if into is not None else None
        if dst is None and own:
            dst = torch.empty(shape, dtype=out.dtype, device=out.device)
        if dst is not None:
            dst.view(tuple(x.shape[:d]) + (n, x.shape[d]) + tuple(x.shape[d + 1 :])).movedim(d, 0).copy_(piece)
            res.append(dst)
        else:
            res.append((piece.movedim(0, d) if d else piece).reshape(shape))
        off += k
    return res


def pack(gs: list[Tensor], dims: Optional[list[int]], n: int, dtype: Optional[torch.dtype]) -> tuple[Tensor, bool]:
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
    if not eager():
        if any(g.dtype != dtype for g in gs):
            gs = [g.to(dtype) for g in gs]
        if dims is None:
            return (torch.cat([g.reshape(-1) for g in gs]) if len(gs) > 1 else gs[0].reshape(-1)), False
        rows = []
        for g, d in zip(gs, dims):
            s = tuple(g.shape)
            rows.append(g.reshape(s[:d] + (n, s[d] // n) + s[d + 1 :]).movedim(d, 0).reshape(n, -1))
        return (torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1)), False
    if len(gs) == 1 and gs[0].dtype == dtype and gs[0].is_contiguous() and (dims is None or dims[0] == 0):
        return gs[0].reshape(-1), False  # already laid out as the collective wants: no copy
    total = sum(g.numel() for g in gs)
    flat = torch.empty(total, dtype=dtype, device=gs[0].device)
    off = 0
    for j, g in enumerate(gs):
        s, k = tuple(g.shape), g.numel()
        if dims is None:
            flat[off : off + k].view(s).copy_(g)
        else:
            d = dims[j]
            m = s[d] // n
            dst = flat.view(n, total // n)[:, off // n : (off + k) // n].view((n,) + s[:d] + (m,) + s[d + 1 :])
            dst.copy_(g.reshape(s[:d] + (n, m) + s[d + 1 :]).movedim(d, 0))
        off += k
    return flat, True


def reduce_scatter_flat(
    gs: list[Tensor], dims: list[int], group: str, n: int, wait: bool = True, dtype: Optional[torch.dtype] = None
) -> list[Tensor]:
    """Sum over ``group`` and keep this rank's 1/n block of each tensor along its dim, in one
    collective (the inverse layout of ``gather_flat``), in ``dtype`` (default: the
    tensors' own; NOTE [reduce in place of the casts])."""
    return land(issue_reduce_scatter(gs, dims, group, n, dtype), wait)


def issue_reduce_scatter(
    gs: list[Tensor], dims: list[int], group: str, n: int, dtype: Optional[torch.dtype] = None
) -> tuple[Tensor, list]:
    """``reduce_scatter_flat``'s collective, issued and not waited for: (its result, the
    shapes ``land`` cuts it into)."""
    shapes = []
    for g, d in zip(gs, dims):
        s = tuple(g.shape)
        shapes.append(s[:d] + (s[d] // n,) + s[d + 1 :])
    return compat.reduce_scatter_single(pack(gs, dims, n, dtype)[0], "sum", 0, group), shapes


def all_reduce_flat(
    gs: list[Tensor], group: str, wait: bool = True, dtype: Optional[torch.dtype] = None
) -> list[Tensor]:
    return land(issue_all_reduce(gs, group, dtype), wait)


def issue_all_reduce(gs: list[Tensor], group: str, dtype: Optional[torch.dtype] = None) -> tuple[Tensor, list]:
    """``all_reduce_flat``'s collective, issued and not waited for (as ``issue_reduce_scatter``)."""
    shapes = [tuple(g.shape) for g in gs]
    flat, own = pack(gs, None, 1, dtype)
    if own:
        # The packed buffer is a fresh buffer of our own: reduce it in place.  funcol's
        # all_reduce would allocate and fill a second buffer of the same size; on 4 gloo
        # ranks of a 2-core machine, four 2.9 MB all-reduces took 50 ms out of place against
        # 39 ms in place (benchmarks/gloo_collectives.py).  Traced code keeps the
        # functional op (the compiler plans its buffers).
        return all_reduce_inplace(flat, group, False), shapes
    return compat.all_reduce(flat, "sum", group), shapes


def land(issued: tuple[Tensor, list], wait: bool = True) -> list[Tensor]:
    """The tensors of an issued flat reduction: waited for (``wait``), or left in flight
    (views of the collective's result, which wait at their first use)."""
    out, shapes = issued
    return split_flat(waited(out) if wait else out, shapes)


def all_reduce_inplace(flat: Tensor, group: str, wait: bool) -> Tensor:
    """Sum ``flat`` over ``group`` in place (eager only); ``wait=False``: left in flight as
    an AsyncCollectiveTensor."""
    return compat.all_reduce_inplace(flat, "sum", group, wait)


def split_flat(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    res, off = [], 0
    for s in shapes:
        k = 1
        for v in s:
            k *= v
        res.append(flat[off : off + k].view(s))
        off += k
    return res


def by_dtype(idx: list[int], xs: list[Tensor]) -> list[list[int]]:
    """Indices grouped by dtype (one flat buffer has one dtype)."""
    return group_indices(idx, xs, {})


def group_indices(idx: list[int], xs: list[Tensor], key: dict, dtype: Optional[torch.dtype] = None) -> list[list[int]]:
    """Indices grouped by dtype (``dtype``, where given, for all) and ``key[j]``."""
    out: dict[tuple, list[int]] = {}
    for j in idx:
        out.setdefault((dtype or xs[j].dtype, key.get(j)), []).append(j)
    return list(out.values())


#: NOTE [reductions in flight]
#:     How many chunks' collectives a waiting ``flat_moves`` keeps in flight: the next
#:     chunk's first collective is issued before the one before it is waited for, so that
#:     gloo's worker threads (NCCL's stream) have the next one queued while the previous
#:     one finishes, instead of the process waiting between them.  Measured on 2 cores
#:     (benchmarks/gloo_collectives.py --reps 31 [--pairs], results in
#:     benchmarks/results/gloo_inflight/; 11.8 MB as four reduce-scatters): over 4 ranks,
#:     32.5 ms one after the other, 24.2 ms two in flight, 22.6 ms all four; over pairs
#:     of ranks, two pairs at once (the data axis inside a stage of pp=2 x fsdp=2), 18.8,
#:     16.4 and 15.9 ms.  Two in flight: at most two chunks' buffers at once, each no
#:     larger than a block (NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py); a chunk's
#:     later moves (over a second mesh dim) are made when its first lands, so no more than
#:     two chunks are ever between moves.
IN_FLIGHT = 2


def flat_moves(
    xs: list,
    pls: list,
    tg: list,
    sizes: Sequence[int],
    groups: Sequence[str],
    order: Sequence[tuple[str, int]],
    key: Optional[dict] = None,
    wait: bool = True,
    into: Optional[dict] = None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Move local tensors ``xs[j]`` (None: skipped), placed ``pls[j]``, toward ``tg[j]`` with
    flat collectives, in place on ``xs`` and ``pls``.  Chunk by chunk (the tensors of one
    ``key[j]``, in order of their first tensor), for each (kind, mesh dim) of ``order``,
    kind "rs" (Partial -> Shard), "ar" (Partial -> Replicate) or "ag" (Shard -> Replicate):
    one collective for each dtype of the chunk's tensors that make that move, with up to
    ``IN_FLIGHT`` chunks' collectives in flight (NOTE [reductions in flight]).  ``into[j]``:
    where tensor j's last move, an all-gather, is written (``gather_flat``).  ``dtype``: the
    dtype the reductions ("rs", "ar") sum in, each tensor cast as it is packed into the
    collective's buffer (NOTE [reduce in place of the casts]).  ``wait=False``: the
    reductions are left in flight.  A tensor a collective has read is dropped from ``xs``
    until its result lands, so that the caller's reference to it can be the last one.
    Moves not in ``order`` are left to the caller."""
    key = key or {}
    chunks: dict = {}
    for j in range(len(xs)):
        if xs[j] is not None:
            chunks.setdefault(key.get(j), []).append(j)
    mv = _Moves(xs, pls, tg, sizes, groups, into, dtype, wait)
    flight: list = []
    for idx in chunks.values():
        steps = iter(order)
        first = mv.next(idx, steps)
        if first is not None:
            flight.append((idx, steps, first))
        while flight and (not wait or len(flight) >= IN_FLIGHT):
            mv.finish(*flight.pop(0))
    while flight:
        mv.finish(*flight.pop(0))


class _Moves:
    """``flat_moves``'s tensors and targets, and its collectives issued and landed."""

    def __init__(self, xs, pls, tg, sizes, groups, into, dtype, wait):
        self.xs, self.pls, self.tg, self.sizes, self.groups = xs, pls, tg, sizes, groups
        self.into, self.dtype, self.wait = into, dtype, wait

    def next(self, idx: list[int], steps) -> Optional[tuple]:
        """Issue the next move of ``steps`` that some of tensors ``idx`` make: (the move, its
        collectives in flight), or None when none is left."""
        xs, pls, tg = self.xs, self.pls, self.tg
        for kind, i in steps:
            if kind == "ag":
                sel = [j for j in idx if isinstance(pls[j][i], Shard) and isinstance(tg[j][i], Replicate)]
            else:
                want = Shard if kind == "rs" else Replicate
                sel = [j for j in idx if is_sum_partial(pls[j][i]) and isinstance(tg[j][i], want)]
            entries = []
            for grp in group_indices(sel, xs, {}, self.dtype if kind != "ag" else None):
                part = [xs[j] for j in grp]
                g, n = self.groups[i], self.sizes[i]
                if kind == "rs":
                    issued, part = issue_reduce_scatter(part, [tg[j][i].dim for j in grp], g, n, self.dtype), None
                elif kind == "ar":
                    issued, part = issue_all_reduce(part, g, self.dtype), None
                else:
                    issued = issue_gather(part, g)
                for j in grp:
                    xs[j] = None
                entries.append((grp, part, issued))
            if entries:
                return (kind, i), entries
        return None

    def finish(self, idx: list[int], steps, first: tuple) -> None:
        """Land the chunk's collectives in flight, then make its remaining moves."""
        while first is not None:
            move, entries = first
            for entry in entries:
                self.land(move, *entry)
            first = self.next(idx, steps)

    def land(self, move: tuple, grp: list[int], part: Optional[list], issued) -> None:
        (kind, i), pls, tg, into = move, self.pls, self.tg, self.into
        if kind != "ag":
            ys = land(issued, self.wait)
        else:
            last = [
                into is not None and j in into and all(pls[j][k] == tg[j][k] for k in range(len(pls[j])) if k != i)
                for j in grp
            ]
            dims = [pls[j][i].dim for j in grp]
            ys = gather_flat(
                part, dims, self.groups[i], self.sizes[i], issued, [into[j] if ok else None for j, ok in zip(grp, last)]
            )
        for j, y in zip(grp, ys):
            self.xs[j], pls[j][i] = y, tg[j][i]


# --------------------------------------------------------------------------- many tensors at once
def redistribute_flat(
    ts: Sequence[DTensor],
    targets: Sequence[Sequence[Placement]],
    keys: Optional[Sequence] = None,
    into: Optional[Sequence[Optional[DTensor]]] = None,
    wait: bool = True,
    consume: bool = False,
) -> list[DTensor]:
    """``t.redistribute(mesh, target)`` for many DTensors on one mesh, with one flat
    collective per mesh dim, kind, dtype and ``keys[j]`` (a chunk: the optimizer passes the
    block of each parameter, so no buffer is larger than a block) instead of one per tensor
    (the optimizer's ZeRO-1 reduce-scatter and ZeRO-1/2 all-gather of the update).
    Reduce-scatters go outer mesh dim first, then all-reduces, then all-gathers inner dim
    first (NOTE [shard order]); any other move is done per tensor at the end.  ``into[j]``:
    a DTensor placed as ``targets[j]`` whose local tensor receives result j in place when
    its last move is an all-gather (then it is what is returned for j).  ``wait=False``:
    the reductions are left in flight (local tensors that wait at their first use).
    ``consume``: ``ts`` is the caller's list, and each tensor that moves is taken out of it
    (set to None), so that, with no other reference, its memory goes as soon as its
    collective has read it (the optimizer's main gradients, chunk by chunk)."""
    if not ts:
        return []
    mesh = ts[0].device_mesh
    sizes = tuple(mesh.size(i) for i in range(mesh.ndim))
    groups = tuple(mesh.get_group(i).group_name if sizes[i] > 1 else "" for i in range(mesh.ndim))
    tg = [tuple(x) for x in targets]
    live = {j for j in range(len(ts)) if tuple(ts[j].placements) != tg[j]}
    xs: list = [compat.local_tensor(ts[j]) if j in live else None for j in range(len(ts))]
    pls = [list(t.placements) for t in ts]
    meta = [(t.shape, t.stride()) for t in ts]
    kept = list(ts)
    if consume:
        for j in live:
            ts[j] = kept[j] = None
    dims = [i for i in range(mesh.ndim) if sizes[i] > 1]
    order = [("rs", i) for i in dims] + [("ar", i) for i in dims] + [("ag", i) for i in reversed(dims)]
    dst = None
    if into is not None:
        dst = {
            j: compat.local_tensor(d)
            for j, d in enumerate(into)
            if d is not None and compat.local_tensor(d).is_contiguous()
        }
    keyed = dict(enumerate(keys)) if keys is not None else None
    flat_moves(xs, pls, tg, sizes, groups, order, key=keyed, into=dst, wait=wait)
    out = []
    for j, t in enumerate(kept):
        if j not in live:
            out.append(t)
        elif dst is not None and j in dst and xs[j] is dst[j]:
            out.append(into[j])
        else:
            d = dtensor_ops.wrap(xs[j], mesh, pls[j], *meta[j])
            out.append(d if tuple(pls[j]) == tg[j] else d.redistribute(mesh, tg[j]))
    return out


def is_sum_partial(pl: Placement) -> bool:
    return pl.is_partial() and getattr(pl, "reduce_op", "sum") == "sum"
