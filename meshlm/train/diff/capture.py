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
      i-th constrain of that module's call.  A block's output that is a constrained tensor
      takes that constrain's logical axes.
    * Nothing changes what runs: the hooks return nothing and the observer returns nothing;
      each recorded tensor is a detached copy.  In a compiled block the hooks and the
      observer are traced with it (Dynamo replays their list appends after the graph runs),
      at the price of one graph per block instance instead of one per block class while
      recording (the hooks differ per module; the recompile limit is raised for it).
    * Only the forward is recorded: a recompute in backward (activation checkpointing, the
      re-gathering policies) runs the same hooks again and is skipped (``in_backward``); so
      is a pipeline stage's stand-in for another stage's tensor (``Absent``).
    * Gathered once the step's forwards and backwards are done, in the order recorded (the
      same on every rank of a mesh, so the collectives line up; a pipeline stage's ranks
      gather among themselves): a DTensor by ``full_tensor()``; a plain tensor on a mesh of
      more than one device is this rank's rows of a local root or a local block (NOTE [local
      root] in meshlm/runtime/lowering/local_root.py), split over the mesh axes the layout
      splits the batch over, along its ``batch`` dim (dim 0 where no axes were declared),
      and is gathered by those.
    * The micro-batches of a step (``train.grad_accum``) are put back together: the k-th
      record of a name is micro-batch k's (in every schedule, a micro-batch's forward runs
      after the previous one's), and they are concatenated along the batch dim, so that a
      record is the tensor of the step's whole batch whatever the accumulation; one without
      a batch dim is kept per micro-batch (``... (micro-batch j)``).
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
from meshlm.runtime.absent import is_absent
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
    """Records the forward of ``model`` (NOTE [diff capture]): ``watching()`` attaches to it
    for a step's forwards (and backwards), ``records(micro_batches)`` then gives what they
    recorded, gathered and put together."""

    def __init__(self, model: nn.Module, blocks: Optional[set[str]] = None):
        self.model = model
        self.blocks = blocks  # the paths whose outputs to record; None: every @meshlm.block
        self.st = shard_state_or_none(model)
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}  # constrains seen in the running call of each module
        self.taken: list[tuple] = []  # (kind, module, name, axes, tensor), in the order recorded
        self.last: Optional[tuple] = None  # the last constrained tensor and its axes
        self.finished: list[str] = []  # module paths in the order their first call returned

    # ------------------------------------------------------------------ recording
    def _pre(self, path: str) -> None:
        self.stack.append(path)
        self.counts[path] = 0

    def _post(self, path: str, block: bool, out: Any) -> None:
        self.stack.pop()
        if not _live():
            return
        if path not in self.finished:
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
        self.counts[path] = n + 1  # counted on every pipeline stage alike, recorded where it is real
        self.last = (x, tuple(axes))
        self._take("constrain", path, f"constrain {n}", tuple(axes), x)

    def _take(self, kind: str, module: str, name: str, axes, t: Tensor) -> None:
        if not is_absent(t):  # a pipeline stage's stand-in for another stage's tensor
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
            self.last = None

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

    def records(self, micro_batches: int) -> list[Record]:
        """The forward records of a step of ``micro_batches`` micro-batches, gathered (in the
        order recorded: every rank of the mesh calls this alike) and put together (NOTE
        [diff capture]): the k-th record of a name belongs to micro-batch k // c when each
        micro-batch made c of them (the c calls named ``(call i)`` when c > 1), and a
        micro-batch's records are concatenated along the batch dim."""
        gathered = []
        for kind, module, name, axes, t in self.taken:
            value, pl = full_value(t, self.st, axes)
            gathered.append(Record(kind, module, name, axes, pl, value))
        self.taken = []
        occurrences: dict[tuple, list[int]] = {}  # key -> positions in gathered
        for i, r in enumerate(gathered):
            occurrences.setdefault(r.key, []).append(i)
        out: list[tuple[int, Record]] = []  # (where it first ran, record): the step's order
        for key, pos in occurrences.items():
            if len(pos) % micro_batches:  # not the same count in every micro-batch: each on its own
                out += [(i, _renamed(gathered[i], f"{key[2]} (occurrence {k})")) for k, i in enumerate(pos)]
                continue
            calls = len(pos) // micro_batches
            for c in range(calls):
                parts = [pos[j * calls + c] for j in range(micro_batches)]
                name = key[2] if calls == 1 else f"{key[2]} (call {c})"
                out += [(parts[0], r) for r in _together([gathered[i] for i in parts], name)]
        return [r for _i, r in sorted(out, key=lambda x: x[0])]


def _renamed(r: Record, name: str, value: Optional[Tensor] = None) -> Record:
    return Record(r.kind, r.module, name, r.axes, r.placements, r.value if value is None else value)


def _together(parts: list[Record], name: str) -> list[Record]:
    """One tensor of each micro-batch, as the tensor of the whole batch (concatenated along
    its batch dim), or each on its own where it has none."""
    r = parts[0]
    if len(parts) == 1:
        return [_renamed(r, name)]
    if r.value.ndim == 0 or (r.axes is not None and "batch" not in r.axes):
        return [_renamed(p, f"{name} (micro-batch {j})") for j, p in enumerate(parts)]
    if any(p.value.ndim != r.value.ndim for p in parts):
        return [_renamed(p, f"{name} (micro-batch {j})") for j, p in enumerate(parts)]
    return [_renamed(r, name, torch.cat([p.value for p in parts], dim=batch_dim(r.axes)))]


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
