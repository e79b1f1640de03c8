"""Context parallel on meshlm's meshes: attention over a sequence split on the ``cp`` mesh
axis, and the balanced order of that split (private torch APIs: DTensor's dispatcher and
``redistribute_local_tensor``).

NOTE [cp dispatch]
    Under a layout that maps ``seq`` to ``cp`` every activation holds this rank's slice of
    the sequence (NOTE [sequence stays split] in meshlm/runtime/lowering/state.py).  The
    only operation that needs other positions is attention, and it reaches DTensor as CPU
    flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
    backward, what ``F.scaled_dot_product_attention`` lowers to on the CPU).  When its
    query is split over cp on the sequence dim (dim 2 of ``(batch, heads, seq,
    head_dim)``), meshlm runs the op as context-parallel attention on the local tensors
    (``meshlm.runtime.cp``: ring or all-gather of keys and values, exact backward from the
    global log-sum-exp) and returns the output and log-sum-exp split the same way; the
    other mesh axes (batch over dp/fsdp, heads over tp) are local to each rank as in the
    rule of dtensor_sdpa.py.  Any other placement goes to that rule (DTensor gathers the
    sequence first: right, and as much memory as no cp).

    torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) is not
    used: it swaps ``F.scaled_dot_product_attention`` inside a context manager around the
    whole step, requires the caller to name the buffers to shard, permutes the sequence
    without telling position code (RoPE tables, learned positions) about it, and its ring
    runs on the CUDA attention ops only in torch 2.11-2.13 (the CPU flash op has no CP
    handler).  Hooking the op on meshlm's meshes keeps a model unchanged and its positions
    global.

NOTE [balanced chunks]
    With causal attention, the rank holding the end of the sequence attends to every key
    and the first rank to few.  Under ``context.balance: true`` a dim split over ``cp``
    (of n ranks) is cut into 2n chunks and rank r holds chunks r and 2n-1-r, so every rank
    does the same causal work.  To keep every other rule exact, that is what ``Shard(d)``
    on the cp axis *means* on such a mesh: the DTensor's global tensor is in natural
    order, and every move between Shard(d) on cp and anything else permutes (scatter) or
    un-permutes (gather) dim d locally, around torch's own collective
    (``redistribute_local_tensor``, wrapped here for these meshes only).  Position tables
    built from ``torch.arange(seq)`` (RoPE, learned positions, masks) meet the activations
    as replicated tensors and are split the same way, so positions stay global without the
    model knowing.  The data a rank is fed (``meshlm.shard_batch``, ``meshlm train``) is
    its two chunks, and dropout draws the same mask for each element as on one device
    (meshlm/core/rng.py).  What the rule needs: a dim split over cp is split over cp alone
    (the layout check refuses ``seq: [cp, tp]`` with balance) and parameters are never
    stored over cp (refused too), so no checkpoint offset has to know the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlm._torch_compat.dtensor_base import aten


@dataclass(eq=False)
class CpMesh:
    """What meshlm knows about one model's mesh with a cp axis of size > 1 (one per sharded
    model: NOTE [cp settings per model] in meshlm/runtime/cp/active.py)."""

    mesh: object  # the DeviceMesh (compared by value, NOTE [scoped patches] in dtensor_scope.py)
    index: int  # the cp axis's index in the mesh
    size: int
    balance: bool  # NOTE [balanced chunks]
    forward: Callable  # meshlm.runtime.cp.cp_attention_forward(q, k, v, *, group, causal, balanced, scale, variant)
    backward: Callable  # ... cp_attention_backward(dout, q, k, v, out, lse, *, ...)
    variant: str  # "ring" | "allgather"
    refuse: Callable  # refuse(what): raises the error naming the caller (meshlm/runtime/cp/refuse.py)
    owner: str = ""  # where the settings come from (the layout's source), for errors
    alive: Callable[[], bool] = lambda: True  # whether the model it was registered for still lives
    compiled: bool = False  # the model's blocks are compiled (the settings are in their graphs)
    split_outputs: bool = False  # the model's root has returned an output split over cp


# One entry per sharded model with a cp axis; among entries on equal meshes, the last is the
# one in force (``activate``).
_MESHES: list[CpMesh] = []


def register(spec: CpMesh) -> None:
    """Run attention on ``spec.mesh`` as context-parallel attention (NOTE [cp dispatch]),
    with ``spec``'s settings in force on meshes equal to it from now on; entries whose model
    is gone are dropped."""
    _MESHES[:] = [m for m in _MESHES if m.alive()] + [spec]
    _install_redistribute()


def registered(mesh) -> list[CpMesh]:
    """The live entries on meshes equal to ``mesh``."""
    return [m for m in _MESHES if (m.mesh is mesh or m.mesh == mesh) and m.alive()]


def activate(spec: CpMesh) -> None:
    """Put ``spec``'s settings in force on meshes equal to its own."""
    if _MESHES and _MESHES[-1] is spec:
        return
    _MESHES[:] = [m for m in _MESHES if m is not spec and m.alive()] + [spec]


def cp_mesh(mesh) -> Optional[CpMesh]:
    """The entry in force on ``mesh`` (the last live one on an equal mesh), or None."""
    for m in reversed(_MESHES):
        if (m.mesh is mesh or m.mesh == mesh) and m.alive():
            return m
    return None


# ------------------------------------------------------------------ balanced order


def balanced_index(length: int, n: int, device=None) -> torch.Tensor:
    """Natural positions in balanced order: chunks 0, 2n-1, 1, 2n-2, ... of ``length / 2n``
    (rank r's contiguous share of the permuted dim is chunks r and 2n-1-r)."""
    if length % (2 * n):
        raise ValueError(
            f"a dim of {length} split over cp={n} with context.balance: true must be a multiple of 2*cp = {2 * n}"
        )
    c = length // (2 * n)
    order = []
    for r in range(n):
        order += [r, 2 * n - 1 - r]
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in order]).to(device)


def to_balanced(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` (whole along ``dim``, natural order) in balanced order."""
    return t.index_select(dim, balanced_index(t.shape[dim], n, t.device))


def from_balanced(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` (whole along ``dim``, balanced order) in natural order."""
    inv = torch.argsort(balanced_index(t.shape[dim], n))
    return t.index_select(dim, inv.to(t.device))


_ORIGINAL: dict = {}


def _install_redistribute() -> None:
    """Wrap torch's ``redistribute_local_tensor`` where DTensor calls it (its redistribute,
    its dispatcher, its API), once; inert on meshes without a balanced cp axis."""
    if _ORIGINAL:
        return
    import torch.distributed.tensor._api as api
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as redist

    orig = redist.redistribute_local_tensor
    _ORIGINAL["fn"] = orig

    def redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
        spec = cp_mesh(current_spec.mesh) if _MESHES else None
        if spec is None or not spec.balance:
            return orig(local_tensor, current_spec, target_spec, **kwargs)
        return _balanced_redistribute(orig, spec, local_tensor, current_spec, target_spec, kwargs)

    for mod in (redist, dispatch, api):
        if getattr(mod, "redistribute_local_tensor", None) is orig:
            mod.redistribute_local_tensor = redistribute_local_tensor


def _with(spec_, i: int, placement):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    pl = list(spec_.placements)
    pl[i] = placement
    return DTensorSpec(spec_.mesh, tuple(pl), tensor_meta=spec_.tensor_meta)


def _balanced_redistribute(orig, cp: CpMesh, local, cur, tgt, kwargs):
    """NOTE [balanced chunks]: torch's redistribute with Shard(d) on the cp axis meaning
    rank r holds chunks r and 2n-1-r of dim d."""
    i = cp.index
    a, b = cur.placements[i], tgt.placements[i]
    leave = is_split(a) and a != b
    enter = is_split(b) and a != b
    if not leave and not enter:
        return orig(local, cur, tgt, **kwargs)
    kw = dict(kwargs)
    kw["async_op"] = False
    if leave:
        mid = _with(cur, i, Replicate())
        local = orig(local, cur, mid, **kw)
        _check_whole(local, cur, a.dim)
        local = _reorder(local, a, cp.size, from_balanced)
        cur = mid
    if enter:
        mid = _with(tgt, i, cur.placements[i])
        local = orig(local, cur, mid, **kw)
        _check_whole(local, mid, b.dim)
        local = _reorder(local, b, cp.size, to_balanced)
        cur = mid
    return orig(local, cur, tgt, **kwargs)


def is_split(p) -> bool:
    """A split of a dim: Shard, or _StridedShard (not a Shard subclass in torch 2.13)."""
    return isinstance(p, (Shard, _StridedShard))


def _reorder(local, placement, n: int, fn):
    """``fn`` (to or from balanced order) along the dim ``placement`` splits.  A
    _StridedShard(d, split_factor=f) splits dim d seen as (f, L/f), the flattening of an
    outer dim of f with a split inner one (rows of a sequence split over cp): the order
    applies to the inner factor, row by row."""
    d = placement.dim
    f = getattr(placement, "split_factor", 1)
    if f == 1:
        return fn(local, d, n)
    shape = local.shape
    inner = local.reshape(*shape[:d], f, shape[d] // f, *shape[d + 1 :])
    return fn(inner, d + 1, n).reshape(shape)


def _check_whole(local, spec_, d: int) -> None:
    n = spec_.tensor_meta.shape[d] if spec_.tensor_meta is not None else local.shape[d]
    if local.shape[d] != n:
        raise RuntimeError(
            f"context.balance: dim {d} is split over cp and another mesh axis ({spec_.placements}); with balanced "
            "chunks a dim may be split over cp alone (set context.balance: false in the layout, or do not split the "
            "sequence over another axis too)"
        )


# ------------------------------------------------------------------ attention


def _is_cp_split(x, cp: CpMesh) -> bool:
    return isinstance(x, DTensor) and isinstance(x.placements[cp.index], Shard) and x.placements[cp.index].dim == 2


def _common(args, cp: CpMesh, n: int):
    """The first ``n`` tensor arguments placed as the query (its placements with any
    Partial reduced), as local tensors; and those placements."""
    q = args[1] if n == 6 else args[0]  # forward: (q, k, v, ...); backward: (dout, q, k, v, out, lse, ...)
    pl = tuple(Replicate() if p.is_partial() else p for p in q.placements)
    out = []
    for t in args[:n]:  # lse (b, h, s) shares dims 0-2 with q: the same placements
        if tuple(t.placements) != pl:
            t = t.redistribute(t.device_mesh, pl)
        out.append(t.to_local())
    return out, pl


def cp_sdpa_handler(fallback: Optional[Callable]):
    """The forward op's handler: context-parallel attention where the query's sequence is
    split over cp on a registered mesh, ``fallback`` (the sharding rule) elsewhere."""

    def handler(op_call, args, kwargs):
        cp = cp_mesh(args[0].device_mesh) if _MESHES and isinstance(args[0], DTensor) else None
        if cp is None or not _is_cp_split(args[0], cp):
            return fallback(op_call, args, kwargs)
        q, k, v = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        if dropout_p:
            cp.refuse(f"attention dropout (dropout_p={dropout_p})")
        if kwargs.get("attn_mask") is not None:
            cp.refuse("an explicit attn_mask")
        (lq, lk, lv), pl = _common((q, k, v), cp, 3)
        group = q.device_mesh.get_group(cp.index)
        out, lse = cp.forward(
            lq,
            lk,
            lv,
            group=group,
            causal=bool(causal),
            balanced=cp.balance,
            scale=kwargs.get("scale"),
            variant=cp.variant,
        )
        o = DTensor.from_local(out, q.device_mesh, pl, run_check=False, shape=q.shape, stride=q.stride())
        lshape = q.shape[:3]
        s = DTensor.from_local(
            lse, q.device_mesh, pl, run_check=False, shape=lshape, stride=torch.empty(lshape, device="meta").stride()
        )
        return o, s

    return handler


def cp_sdpa_backward_handler(fallback: Optional[Callable]):
    """The backward op's handler (see ``cp_sdpa_handler``)."""

    def handler(op_call, args, kwargs):
        q = args[1]
        cp = cp_mesh(q.device_mesh) if _MESHES and isinstance(q, DTensor) else None
        if cp is None or not _is_cp_split(q, cp):
            return fallback(op_call, args, kwargs)
        causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
        (ldo, lq, lk, lv, lo, lse), pl = _common(args[:6], cp, 6)
        group = q.device_mesh.get_group(cp.index)
        dq, dk, dv = cp.backward(
            ldo,
            lq,
            lk,
            lv,
            lo,
            lse,
            group=group,
            causal=bool(causal),
            balanced=cp.balance,
            scale=kwargs.get("scale"),
            variant=cp.variant,
        )
        k, v = args[2], args[3]
        return tuple(
            DTensor.from_local(g, t.device_mesh, pl, run_check=False, shape=t.shape, stride=t.stride())
            for g, t in ((dq, q), (dk, k), (dv, v))
        )

    return handler


def cp_sdpa_rules(rules: dict) -> dict:
    """``rules`` (op -> handler, from dtensor_sdpa.py) with the CPU flash attention ops
    wrapped by the context-parallel handlers."""
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is None:
        return rules
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    out = dict(rules)
    out[fwd.default] = cp_sdpa_handler(rules.get(fwd.default))
    out[bwd.default] = cp_sdpa_backward_handler(rules.get(bwd.default))
    return out
