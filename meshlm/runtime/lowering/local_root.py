"""The local root: a pure data-parallel model's root run on local tensors, its outputs
lifted back to what the DTensor root would return.

NOTE [local root]
    When every block runs on plain local tensors (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py), what
    is left of DTensor's per-op dispatch is the root: the embedding, the final norm, the
    head and the loss.  Under a pure data-parallel layout the root runs on local tensors
    too, as DDP and FSDP2 run a model:
    - the inputs are used as given (each rank's rows);
    - the parameters outside blocks that compute keeps as stored (every one under ddp,
      zero1, zero2) come from one root bucket at the root's entry, so their gradients are
      reduced in one flat collective at the end of backward; those gathered at use
      (fsdp, hsdp) each come from a one-member bucket, gathered where they are used;
    - ``constrain`` only validates its axes against the layout (once per axes and shape)
      and remembers the axes of the tensors it saw;
    - the blocks take and return plain tensors.
    Whether the root runs locally is decided from the inputs alone, before the forward
    runs: every tensor leaf is split by rows (dim 0) over every mesh axis of size > 1, or
    whole (replicated); at least one is split.  The outputs are then lifted back to what
    the DTensor root would have returned, by rules that need no second run:
    - a tensor last seen by ``constrain`` is placed by the axes it was given (its
      ``batch`` dim split as the input rows); any other tensor must be batch-first (its
      dim 0 has this rank's input rows) and becomes batch-sharded;
    - a value passed through ``meshlm.reduce_batch(x, "mean" | "sum")`` is already the
      value over the global batch;
    - a scalar that is an NLL (``F.cross_entropy``, ``F.nll_loss``) over this rank's rows,
      mean or sum, is combined exactly: a mean as sum_r(loss_r * weight_r) / sum_r(weight_r),
      with weight_r the loss's own total weight (its count of targets that are not ignored,
      or their class weights), so ``ignore_index`` and uneven counts stay exact; a sum is
      summed.  Backward scales this rank's gradient by weight_r / sum(weight) (mean) or 1
      (sum), and the buckets sum the parameter gradients over ranks: the gradient of the
      global loss, as under DTensor;
    - anything else (another scalar, a tensor whose batch dim is unknown, a Python number)
      raises an AnnotationError that names the output's path and what to declare.
    On one device every input and output is whole, so everything is returned as it is.
    Local roots run only in eager mode with grad enabled (the loss needs its autograd
    node); evaluation under ``torch.no_grad`` runs under DTensor.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshlm import _torch_compat as compat
from meshlm.core import annotate, rng, tree, weighting
from meshlm.core.axes import DATA_AXES, Axes
from meshlm.core.errors import AnnotationError
from meshlm.core.state import counting, eager, scope
from meshlm.runtime import bucket
from meshlm.runtime.absent import Absent
from meshlm.runtime.lowering.blocks import outer_blocks, register_bucket, submodule, whole_in_compute
from meshlm.runtime.lowering.inputs import input_axes, set_arguments
from meshlm.runtime.lowering.params import pure_data_parallel


@dataclass(frozen=True)
class RootSpec:
    """What a local root gathers at its entry (NOTE [local root])."""

    key: Optional[int]  # the root bucket (parameters compute keeps as stored), None: none
    entries: tuple  # (module path from the root, attribute name) per member of that bucket
    constrain: "LocalHandler"  # the model's constrain handler inside its local root


def root_spec(model: nn.Module, st) -> Optional[RootSpec]:
    """The model's local-root plan, or None if its root must run under DTensor."""
    if not pure_data_parallel(st.layout, st.sizes):
        return None
    inside: set[int] = set()
    for blk in outer_blocks(model):
        spec = getattr(blk, "_meshlm_block", None)
        has_params = any(True for _ in blk.parameters())
        if has_params and (spec is None or spec.key is None or not spec.local):
            return None
        inside.update(id(m) for m in blk.modules())
    data_dims = tuple(i for i, n in enumerate(st.names) if n in DATA_AXES)
    entries, members, at_use = [], [], []
    for path, m in model.named_modules():
        if id(m) in inside:
            continue
        for name, use in getattr(m, "_meshlm_use", {}).items():
            p = m._parameters[name]
            mem = bucket.member(p.placements, use.compute, use.grads, tuple(p.shape), p.dtype, data_dims)
            if mem is None or not whole_in_compute(mem, st):
                return None
            if mem.gather:
                at_use.append((use, mem))
            else:
                entries.append((path, name))
                members.append(mem)
    for use, mem in at_use:
        use.local_key = register_bucket(st, [mem], True)
    key = register_bucket(st, members, True) if members else None
    return RootSpec(key, tuple(entries), LocalHandler(st))


class LocalHandler(rng.Handler):
    """``constrain`` inside a local root: the layout's rules still apply to the annotation
    (checked in eager mode, once per axes and local shape); the tensor is returned as it is,
    and its axes are remembered for lifting the outputs (NOTE [local root]).  Also
    ``reduce_batch``, and ``dropout`` on this rank's rows (NOTE [dropout keys] in rng.py).
    One handler per model: compiled blocks guard on it."""

    def __init__(self, st):
        sizes = tuple(st.sizes[n] for n in st.names)
        self.st = st
        self.world = st.mesh.size()  # pure data parallelism: the batch is split over every device
        super().__init__(self._constrain, st.coord, sizes, rows=(rng.rank_index(st.coord, sizes), self.world))
        self.checked: set = set()
        self.seen: dict[int, tuple[weakref.ref, Axes]] = {}

    def _constrain(self, x: Tensor, axes: Axes) -> Tensor:
        annotate.check_axes_count(x, axes)
        if torch.compiler.is_compiling():
            return x
        k = (tuple(axes), tuple(x.shape))
        if k not in self.checked:
            gshape = tuple(n * self.world if a == "batch" else n for a, n in zip(axes, x.shape))
            self.st.activation_placements(axes, gshape)
            self.checked.add(k)
        self.seen[id(x)] = (weakref.ref(x), tuple(axes))
        return x

    def axes_of(self, x: Tensor) -> Optional[Axes]:
        got = self.seen.get(id(x))
        return got[1] if got is not None and got[0]() is x else None

    def reduce_batch(self, x: Tensor, op: str, weight: Optional[Tensor] = None) -> Tensor:
        if op == "mean" and weight is None:
            weight = _nll_weight(x)
        if self.world == 1:
            out = x if weight is None else weighting.attach(x.view_as(x), weight)
        else:
            out = batch_reduce(x, weight, op, _data_groups(self.st))
        out._meshlm_global = True  # already over the global batch: lifted as it is
        return out


def _data_groups(st) -> tuple[str, ...]:
    return tuple(st.mesh.get_group(i).group_name for i, n in enumerate(st.sizes.values()) if n > 1)


def local_rows(model: nn.Module, st, leaves: list[tuple[str, Tensor]]):
    """(rows, placements of the row-split inputs) if the root may run on local tensors with
    these inputs, else None (NOTE [local root]); rows is None on one device."""
    sizes = tuple(st.sizes.values())
    if all(n == 1 for n in sizes):  # one device: every input and output is whole
        return None, tuple(Replicate() for _ in sizes)
    rows, rows_pl = None, None
    for path, val in leaves:
        if isinstance(val, DTensor):
            return None
        pl = tuple(st.input_placements(input_axes(model, path, val.ndim)))
        if val.ndim >= 1 and all(isinstance(p, Shard) and p.dim == 0 for p, n in zip(pl, sizes) if n > 1):
            if rows is not None and (rows, rows_pl) != (val.shape[0], pl):
                return None
            rows, rows_pl = val.shape[0], pl
        elif any(not isinstance(p, Replicate) for p, n in zip(pl, sizes) if n > 1):
            return None
    return None if rows_pl is None else (rows, rows_pl)


def local_root_forward(self, st, orig, bound, inputs, rows_and_pl):
    """The root's forward on local tensors, its outputs lifted (NOTE [local root])."""
    rows, rows_pl = rows_and_pl
    spec: RootSpec = st.root
    dev = st.mesh.device_type
    set_arguments(bound, tree.map_tensors(inputs, lambda _p, t: t if t.device.type == dev else t.to(dev)))
    mods = [submodule(self, path) for path, _n in spec.entries]
    handler = spec.constrain
    try:
        with counting("local_root"), scope(handler=handler):
            if spec.key is not None:
                params = [m._parameters[n] for m, (_p, n) in zip(mods, spec.entries)]
                kept = st.gathered if eager() else None  # NOTE [gathered once per step]
                ts = kept.get("root") if kept is not None else None
                if ts is None:
                    ts = bucket.gather(spec.key, True, *params)
                    if kept is not None:
                        kept["root"] = ts
                for m, (_p, n), t in zip(mods, spec.entries, ts):
                    m._meshlm_now[n] = t
            out = orig(*bound.args, **bound.kwargs)
            st.roots["local"] += 1
            if rows is not None:
                _check_no_numbers(out)
            return tree.map_tensors(out, lambda path, t: _lift(path, t, st, handler, rows_pl, rows), strict=False)
    finally:
        for m, (_p, n) in zip(mods, spec.entries):
            m._meshlm_now.pop(n, None)
        handler.seen.clear()


def _lift(path: str, out: Tensor, st, handler: LocalHandler, rows_pl: tuple, rows: Optional[int]):
    """One output leaf of a local root as the DTensor root would return it (NOTE [local
    root]); ``rows`` is None on one device, where every tensor is whole."""
    if isinstance(out, (DTensor, Absent)):  # Absent: on another pipeline stage (NOTE [absent values])
        return out
    name = f"output `{path}`" if path else "the output"
    sizes = tuple(st.sizes.values())
    if rows is None or getattr(out, "_meshlm_global", False):
        return out if out.ndim == 0 or rows is not None else bucket.wrap_local(out, st.mesh, sizes, rows_pl)
    if out.ndim == 0:
        nll = compat.nll_node_fields(out.grad_fn)
        if nll is None or nll[0] not in (1, 2):
            raise AnnotationError(
                f"{name} is a scalar computed on this rank's rows under a data-parallel layout, and meshlm cannot "
                "tell how it combines over the batch (it is not an F.cross_entropy / F.nll_loss): return "
                "meshlm.reduce_batch(x, 'mean') for a mean over equal per-rank rows, or "
                "meshlm.reduce_batch(x, 'sum') for a sum (NOTE [local root] in meshlm/runtime/lowering/local_root.py)"
            )
        if not _nll_rows_ok(nll[2], rows):
            raise AnnotationError(
                f"{name}: its NLL targets do not have this rank's {rows} input rows; return "
                "meshlm.reduce_batch(x, 'mean'|'sum') or compute it on batch-first targets"
            )
        mean = nll[0] == 1
        return batch_reduce(out, nll[1] if mean else None, "mean" if mean else "sum", _data_groups(st))
    axes = handler.axes_of(out)
    if axes is None:
        if out.shape[0] != rows:
            raise AnnotationError(
                f"{name} of shape {tuple(out.shape)} is not batch-first (dim 0 is not this rank's {rows} input rows) "
                "and was not passed through meshlm.constrain, so meshlm cannot tell which dim holds the batch: "
                "return it through constrain(x, axes) with its logical axes, or meshlm.reduce_batch(x, 'mean'|'sum') "
                "if it is reduced over the batch"
            )
        return bucket.wrap_local(out, st.mesh, sizes, rows_pl)
    if "batch" not in axes:
        raise AnnotationError(
            f"{name} has logical axes {axes} without 'batch': under a data-parallel layout each "
            "rank computed it on its own rows; reduce it with meshlm.reduce_batch(x, 'mean'|'sum')"
        )
    d = axes.index("batch")
    pl = tuple(Shard(d) if isinstance(p, Shard) else p for p in rows_pl)
    gshape = list(out.shape)
    gshape[d] *= st.mesh.size()
    return DTensor.from_local(
        out, st.mesh, pl, run_check=False, shape=torch.Size(gshape), stride=torch.empty(gshape, device="meta").stride()
    )


def _check_no_numbers(out: Any) -> None:
    """A Python number returned by a local root was computed from this rank's rows only."""
    for path, v in tree.leaves(out):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            raise AnnotationError(
                f"output `{path or '(the whole output)'}` is a Python {type(v).__name__} computed on this rank's rows "
                "under a data-parallel layout, so it differs between ranks: return a tensor instead (through "
                "meshlm.reduce_batch(x, 'mean'|'sum') if it is reduced over the batch)"
            )


def _nll_weight(loss: Tensor) -> Optional[Tensor]:
    """The total weight of a mean NLL (its count of targets not ignored, or their class
    weights), or None if ``loss`` is not a mean NLL."""
    nll = compat.nll_node_fields(loss.grad_fn)
    if loss.ndim != 0 or nll is None or nll[0] != 1:
        return None
    return nll[1]


def _nll_rows_ok(target: Tensor, rows: int) -> bool:
    return target.ndim > 0 and target.shape[0] % rows == 0


def batch_reduce(x: Tensor, weight: Optional[Tensor], op: str, groups) -> Tensor:
    """``BatchReduce``; a weighted mean carries its global total weight (NOTE [token
    weighting] in meshlm/core/weighting.py)."""
    out, total = BatchReduce.apply(x, weight, op, groups)
    return out if weight is None else weighting.attach(out, total)


class BatchReduce(torch.autograd.Function):
    """This rank's value over its rows -> the value over every rank's rows (a mean weighted
    by ``weight``, one per rank where None, or a sum); backward hands this rank its share of
    the gradient (NOTE [local root])."""

    @staticmethod
    def forward(ctx, x, weight, op, groups):  # type: ignore[override]
        mean = op == "mean"
        xf = x.detach().to(torch.float32)
        if mean:
            w = (weight.detach() if weight is not None else torch.ones((), device=x.device)).to(torch.float32)
            # a rank whose rows count no target has a NaN mean (0/0) and weight 0: it adds nothing
            buf = torch.cat([torch.where(w > 0, xf * w, torch.zeros_like(xf)).reshape(-1), w.reshape(1)])
        else:
            buf = xf.reshape(-1)
        for g in groups:
            buf = bucket.waited(compat.all_reduce(buf, "sum", g))
        if mean:
            ctx.scale = w / buf[-1]
            out, total = (buf[:-1] / buf[-1]).view(x.shape), buf[-1].clone()
        else:
            ctx.scale = None
            out, total = buf.view(x.shape), torch.zeros((), device=x.device)
        ctx.mark_non_differentiable(total)
        return out.to(x.dtype), total

    @staticmethod
    def backward(ctx, g, _total):  # type: ignore[override]
        return (g if ctx.scale is None else g * ctx.scale.to(g.dtype)), None, None, None
