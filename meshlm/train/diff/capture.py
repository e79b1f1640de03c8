"""Recording a forward: every block's output and every ``constrain``ed activation, with the
module path that produced it, gathered to its full logical value.

NOTE [diff capture]
    What is recorded, and how, so that two sides of a diff name the same tensor alike:

    * Where: a forward pre-hook and a forward hook on every submodule keep a stack of module
      paths, so that an activation is named by the innermost module running when it was
      made.  A block (``@meshlm.block``) records its output (``output``; ``output.<path>``
      for each tensor of a structured output) in its forward hook; every ``constrain`` is
      seen through ``meshlm.core.annotate.observing`` (the lowering's handler runs first, so
      the recorded tensor is the one the model goes on with) and named ``constrain <i>``, the
      i-th constrain of that module in this micro-batch.  A block's output that is a
      constrained tensor takes that constrain's logical axes.
    * Nothing changes what runs: the hooks return nothing and the observer returns nothing;
      each recorded tensor is a detached copy.  In a compiled block the hooks and the
      observer are traced with it (Dynamo replays their list appends after the graph runs),
      at the price of one graph per block instance instead of one per block class while
      recording (the hooks differ per module; the recompile limit is raised for it).
    * Only the forward is recorded: a recompute in backward (activation checkpointing, the
      re-gathering policies) runs the same hooks again and is skipped (``in_backward``).
    * Gathered at the end of each micro-batch, in the order recorded (the same on every
      rank, so the collectives line up): a DTensor by ``full_tensor()``; a plain tensor on a
      mesh of more than one device is this rank's rows of a local root or a local block
      (NOTE [local root] in meshlm/runtime/lowering/local_root.py), split over the mesh axes
      the layout splits the batch over, along its ``batch`` dim (dim 0 where no axes were
      declared), and is gathered by those.
    * The micro-batches of a step (``train.grad_accum``) are put back together along the
      batch dim, so that a record is the tensor of the step's whole batch whatever the
      accumulation; one without a batch dim is kept per micro-batch (``... (micro-batch j)``).
    * The hooks are torch's, every handle removed when recording ends (``_attach``, the one
      place that attaches to the model).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshlm import _torch_compat as compat
from meshlm.core import annotate, tree
from meshlm.core.errors import MeshlmError
from meshlm.train.diff.record import Record


def shard_state_or_none(model: nn.Module):
    """The lowering's state of ``model``, None for a plain module."""
    from meshlm.runtime.lowering import shard_state

    try:
        return shard_state(model)
    except MeshlmError:
        return None


def describe(t: Tensor, st, local_pl: Optional[tuple] = None) -> str:
    """How a side held ``t``: its placements by mesh axis, "local rows (...)" for a plain
    tensor of this rank's rows, "whole" for a plain tensor on one device."""
    if isinstance(t, DTensor):
        names = t.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(t.device_mesh.ndim))
        return " ".join(f"{n}:{_short(p)}" for n, p in zip(names, t.placements))
    if local_pl is None:
        return "whole"
    return "local rows (" + " ".join(f"{n}:{_short(p)}" for n, p in zip(st.names, local_pl)) + ")"


def _short(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return str(p)


def batch_dim(axes: Optional[tuple]) -> int:
    """The dim a tensor's rows are on: its ``batch`` axis, else dim 0 (NOTE [diff capture])."""
    return axes.index("batch") if axes is not None and "batch" in axes else 0


def rows_placements(st, dim: int) -> Optional[tuple]:
    """The placements of a plain tensor holding this rank's rows along ``dim`` (None when
    the mesh has one device or there is no lowering state: the tensor is whole)."""
    if st is None or all(n == 1 for n in st.sizes.values()):
        return None
    pl = st.input_placements(("batch",))
    return tuple(Shard(dim) if isinstance(p, Shard) else p for p in pl)


def full_value(t: Tensor, st, axes: Optional[tuple]) -> tuple[Tensor, str]:
    """A copy of ``t``'s full logical value on the CPU, and how this side held it (NOTE [diff
    capture]).  A copy: a gathered tensor can be the stored one itself (one device), which the
    step then changes in place."""
    if isinstance(t, DTensor):
        return t.full_tensor().detach().cpu().clone(), describe(t, st)
    pl = rows_placements(st, batch_dim(axes))
    if pl is None:
        return t.detach().cpu().clone(), describe(t, st)
    d = DTensor.from_local(t.detach(), st.mesh, pl, run_check=False)
    return d.full_tensor().cpu().clone(), describe(t, st, pl)


def _live() -> bool:
    """Record here: in the forward, not in a recompute inside backward (a compiled graph's
    recompute runs inside its backward graph, never these hooks)."""
    return torch.compiler.is_compiling() or not compat.in_backward()


class Recorder:
    """Records the forward of ``model`` (NOTE [diff capture]); ``watching()`` attaches to it,
    ``micro_batch(j)`` brackets one micro-batch's forward and backward, ``records()`` then
    gives them gathered and put together."""

    def __init__(self, model: nn.Module, blocks: Optional[set[str]] = None):
        self.model = model
        self.blocks = blocks  # the paths whose outputs to record; None: every @meshlm.block
        self.st = shard_state_or_none(model)
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}
        self.taken: list[tuple] = []  # (kind, module, name, axes, tensor) of this micro-batch
        self.last: Optional[tuple] = None  # the last constrained tensor and its axes
        self.micro: list[list[Record]] = []  # gathered, per micro-batch
        self.finished: list[str] = []  # module paths in the order their first call returned

    # ------------------------------------------------------------------ recording
    def _pre(self, path: str) -> None:
        self.stack.append(path)

    def _post(self, path: str, block: bool, out: Any) -> None:
        self.stack.pop()
        if not _live():
            return
        if not self.micro and path not in self.finished:
            self.finished.append(path)
        if not block:
            return
        leaves = tree.tensor_leaves(out) if not isinstance(out, Tensor) else [("", out)]
        for sub, t in leaves:
            axes = self.last[1] if self.last is not None and self.last[0] is t else None
            self._take("block", path, f"output.{sub}" if sub else "output", axes, t)

    def _seen(self, x: Tensor, axes) -> None:
        if not _live() or not isinstance(x, Tensor):
            return
        path = self.stack[-1] if self.stack else ""
        n = self.counts.get(path, 0)
        self.counts[path] = n + 1
        self.last = (x, tuple(axes))
        self._take("constrain", path, f"constrain {n}", tuple(axes), x)

    def _take(self, kind: str, module: str, name: str, axes, t: Tensor) -> None:
        self.taken.append((kind, module, name, axes, t.detach().clone()))

    @contextlib.contextmanager
    def watching(self) -> Iterator["Recorder"]:
        """Hooks and the constrain observer attached for the block, removed after it."""
        handles = _attach(self.model, self)
        try:
            with annotate.observing(self._seen):
                yield self
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def micro_batch(self, j: int) -> Iterator[None]:
        """One micro-batch's forward (and its backward): its records gathered at the end."""
        self.counts, self.taken, self.last = {}, [], None
        yield
        self.micro.append(self._gathered())
        self.taken, self.last = [], None

    def _gathered(self) -> list[Record]:
        out = []
        seen: dict[tuple, int] = {}
        for kind, module, name, axes, t in self.taken:
            key = (kind, module, name)
            if key in seen:  # a module called again in one micro-batch (its own counter) or a block twice
                seen[key] += 1
                name = f"{name} (call {seen[key]})"
            else:
                seen[key] = 0
            value, pl = full_value(t, self.st, axes)
            out.append(Record(kind, module, name, axes, pl, value))
        return out

    # ------------------------------------------------------------------ the step's records
    def backward_order(self, fqns: list[str]) -> list[str]:
        """Parameter FQNs in the order backward makes their gradients, as far as the forward
        tells: a module's parameters count as used when its first call returned (a
        container's own parameters, such as a head next to the blocks, after its children),
        later ones first; within a module, the later registered first; a parameter of a
        module that never ran last."""
        pos = {p: i for i, p in enumerate(self.finished)}
        idx = {f: i for i, f in enumerate(fqns)}
        return sorted(fqns, key=lambda f: (-pos.get(f.rpartition(".")[0], -1), -idx[f]))

    def records(self) -> list[Record]:
        """The forward records of the whole step, micro-batches put together (NOTE [diff capture])."""
        if len(self.micro) == 1:
            return list(self.micro[0])
        per = [{r.key: r for r in m} for m in self.micro]
        out = []
        for r in self.micro[0]:
            parts = [p.get(r.key) for p in per]
            shapes_ok = all(
                p is not None and p.value.ndim == r.value.ndim and p.value.ndim > 0 for p in parts
            ) and not (r.axes is not None and "batch" not in r.axes)
            if shapes_ok:
                d = batch_dim(r.axes)
                value = torch.cat([p.value for p in parts], dim=d)
                out.append(Record(r.kind, r.module, r.tensor, r.axes, r.placements, value))
                continue
            for j, p in enumerate(parts):
                if p is not None:
                    out.append(Record(p.kind, p.module, f"{p.tensor} (micro-batch {j})", p.axes, p.placements, p.value))
        return out


def _attach(model: nn.Module, rec: Recorder) -> list:
    """The recorder's hooks on every submodule of ``model`` (NOTE [diff capture]): the one
    place that attaches to the model, so that another way of attaching (a hook interface of
    the runtime) changes this function only.  Returns the handles to remove."""
    handles = []
    mods = list(model.named_modules())
    for path, m in mods:
        block = annotate.is_block(m) if rec.blocks is None else path in rec.blocks
        handles.append(m.register_forward_pre_hook(lambda _m, _a, path=path: rec._pre(path)))
        handles.append(
            m.register_forward_hook(
                lambda _m, _a, out, path=path, block=block: rec._post(path, block, out), always_call=True
            )
        )
    # each hooked block traces its own graph while recording (NOTE [diff capture])
    compat.raise_recompile_limit(2 * len(mods) + 16)
    return handles
