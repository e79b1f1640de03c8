"""Collective accounting: every collective a training step runs, with its kind, mesh axes
and logical bytes per rank.

``with CommCounter(mesh) as cc: <forward, backward, optimizer step>`` records each
collective that reaches the dispatcher: the functional collectives DTensor's redistribute
issues (``torch.ops._c10d_functional.*``) and the in-place c10d ops behind
``torch.distributed.all_reduce`` and friends.  It is a ``TorchDispatchMode``, so it sees
the plain local tensors DTensor hands to the collective (their real sizes) and the
process-group name, which it maps back to the mesh axis (or axes) the group spans.

NOTE [logical bytes]
    ``Collective.bytes`` is the size of the *logical* tensor the collective is about, per
    rank: the gathered output of an all-gather, the (unscattered) input of a
    reduce-scatter, the input of an all-reduce or all-to-all, the tensor a point-to-point
    send or receive moves (pipeline stages).  ``wire_bytes`` is what a ring algorithm
    sends per rank for it: (N-1)/N of that for all-gather, reduce-scatter and all-to-all,
    2(N-1)/N for all-reduce (docs/layouts.md, shipped layouts), all of it for a send and none for a
    receive.  Gloo emulates reduce-scatter
    with an all-reduce, so its real traffic and time differ: count, never time, gloo.

Phases: a collective issued while autograd runs a backward pass is ``"backward"``; any
other is tagged with the phase set by ``cc.phase(name)`` (``"forward"`` by default).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat

_f = compat.c10d_functional
_c = torch.ops.c10d

# functional op packet -> (kind, index of the input tensor, index of the group name,
# multiply the input size by the group size to get the logical bytes)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, 2, False),
    "all_reduce_": ("all_reduce", 0, 2, False),
    "all_gather_into_tensor": ("all_gather", 0, 2, True),
    "all_gather_into_tensor_out": ("all_gather", 0, 2, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3, False),
    "all_to_all_single": ("all_to_all", 0, 3, False),  # (input, output splits, input splits, group)
    "broadcast": ("broadcast", 0, 2, False),
    "broadcast_": ("broadcast", 0, 2, False),
}
_FUNCTIONAL_COALESCED = {
    "all_reduce_coalesced": ("all_reduce", 2, False),
    "all_reduce_coalesced_": ("all_reduce", 2, False),
    "all_gather_into_tensor_coalesced": ("all_gather", 2, True),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3, False),
}
# c10d in-place ops: kind, and whether arg 0 is a list of tensors (else one tensor) that is
# the logical tensor (outputs for all-gather).
_C10D = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
}

# DTensor ops whose handler issues collectives of its own that a step must count (cp attention)
_SEEN_INSIDE = {
    op.default
    for op in (
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
    )
    if op is not None
}
# point-to-point: c10d's send and recv (pipeline stages; what torch.distributed.isend, irecv
# and batch_isend_irecv run), the tensor's bytes, group = the process group's
_P2P = {"send": "send", "recv_": "recv"}

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", "recv")


def ring_factor(kind: str, n: int) -> float:
    """Bytes a ring algorithm sends per rank, as a fraction of the logical bytes."""
    if kind in ("send", "recv"):  # what this rank puts on the wire: a send's bytes, a receive none
        return 1.0 if kind == "send" else 0.0
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass(frozen=True)
class Collective:
    """One collective call as a rank saw it (NOTE [logical bytes])."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    bytes: int
    dtype: torch.dtype
    phase: str
    device: str = "?"  # the device type of the tensor moved ("cpu", "cuda")

    @property
    def wire_bytes(self) -> float:
        return self.bytes * ring_factor(self.kind, self.group_size)


def _resolve(name: str):
    return compat.resolve_process_group(name)


def _ranks(pg) -> tuple[int, ...]:
    """The sorted global ranks a process group spans (NOTE [groups by ranks])."""
    return tuple(sorted(dist.get_process_group_ranks(pg)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter(compat.TorchDispatchMode):
    """Records every collective run inside it; see the module docstring.

    ``mesh`` (a DeviceMesh) names the groups: each mesh dim's group maps to its axis name,
    the world group to every axis.  Groups it cannot name are reported as ``("?",)``."""

    def __init__(self, mesh=None):
        super().__init__()
        self.records: list[Collective] = []
        self._phase = "forward"
        # NOTE [groups by ranks]: a group is named by the set of global ranks it spans, not
        # by its c10d name.  Building a second mesh of the same shape in one process (as a
        # test pool does) gives DeviceMesh new group names while DTensor may still issue
        # collectives on groups of the first, equal in ranks; matching names fails there.
        self._by_ranks: dict[tuple[int, ...], tuple[str, ...]] = {}
        self._cache: dict[str, tuple[str, ...]] = {}
        if mesh is not None:
            names = tuple(mesh.mesh_dim_names or ())
            for i, n in enumerate(names):
                self._by_ranks[_ranks(mesh.get_group(i))] = (n,)
            if names and dist.is_initialized():
                self._by_ranks.setdefault(tuple(range(dist.get_world_size())), names)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag collectives issued outside autograd's backward with ``name``."""
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    # ------------------------------------------------------------------ recording
    def _axes(self, group) -> tuple[str, ...]:
        group = compat.unbox_group(group)
        name = group if isinstance(group, str) else getattr(group, "group_name", None)
        if name is None:
            return ("?",)
        if name not in self._cache:
            try:
                pg = group if not isinstance(group, str) else _resolve(group)
                self._cache[name] = self._by_ranks.get(_ranks(pg), ("?",))
            except Exception:  # pragma: no cover - a group c10d cannot resolve
                self._cache[name] = ("?",)
        return self._cache[name]

    def _group_size(self, group_name) -> int:
        group_name = compat.unbox_group(group_name)
        try:
            if not isinstance(group_name, str):
                return group_name.size()
            return _resolve(group_name).size()
        except Exception:  # pragma: no cover - unnamed group
            return 0

    def _add(self, kind: str, nbytes: int, t: torch.Tensor, group) -> None:
        in_bwd = compat.in_backward()
        self.records.append(
            Collective(
                kind,
                self._axes(group),
                self._group_size(group),
                int(nbytes),
                t.dtype,
                "backward" if in_bwd else self._phase,
                t.device.type,
            )
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SEEN_INSIDE and any(issubclass(t, DTensor) for t in types):
            # context-parallel attention (NOTE [cp dispatch] in meshlm/_torch_compat/dtensor_cp.py)
            # sends keys and values from inside DTensor's handler for the op: let DTensor run it
            # with this mode in force so those collectives are counted (returning the result
            # here would run it with the mode popped).  Other DTensor ops keep the accounting the
            # planner's formulas are written against.
            return NotImplemented
        kwargs = kwargs or {}
        ns = func.namespace
        name = func._opname
        if ns == "_c10d_functional" and name in _FUNCTIONAL:
            kind, ti, gi, mul = _FUNCTIONAL[name]
            t = args[ti]
            group = args[gi] if len(args) > gi else kwargs.get("group_name")
            n = self._group_size(group) if mul else 1
            self._add(kind, _nbytes(t) * n, t, group)
        elif ns == "_c10d_functional" and name in _FUNCTIONAL_COALESCED:
            kind, gi, mul = _FUNCTIONAL_COALESCED[name]
            group = args[gi]
            n = self._group_size(group) if mul else 1
            for t in args[0]:
                self._add(kind, _nbytes(t) * n, t, group)
        elif ns == "c10d" and name in _P2P:
            for t in args[0]:
                self._add(_P2P[name], _nbytes(t), t, args[1])
        elif ns == "c10d" and name in _C10D:
            kind = _C10D[name]
            first = args[0]
            if kind == "all_gather" and name == "allgather_":  # output lists, input list
                ts = [first[0][0]] if first and isinstance(first[0], (list, tuple)) else list(first)
                group = args[2]
                nb = sum(_nbytes(t) for t in (first[0] if isinstance(first[0], (list, tuple)) else first))
                self._add(kind, nb, ts[0], group)
            elif name == "_allgather_base_":
                self._add(kind, _nbytes(args[0]), args[0], args[2])
            elif name == "_reduce_scatter_base_":
                self._add(kind, _nbytes(args[1]), args[1], args[2])
            else:
                ts = list(first) if isinstance(first, (list, tuple)) else [first]
                group = args[1]
                for t in ts:
                    if isinstance(t, (list, tuple)):
                        t = t[0]
                    self._add(kind, _nbytes(t), t, group)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ reports
    def summary(self, by_phase: bool = False) -> dict[tuple, dict[str, float]]:
        """``{(kind, axes[, phase]): {"count", "bytes", "wire_bytes"}}``."""
        out: dict[tuple, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        for r in self.records:
            key = (r.kind, r.axes, r.phase) if by_phase else (r.kind, r.axes)
            e = out[key]
            e["count"] += 1
            e["bytes"] += r.bytes
            e["wire_bytes"] += r.wire_bytes
        return dict(out)

    def table(self) -> str:
        """A readable per-(kind, axes, phase) table."""
        rows = sorted(self.summary(by_phase=True).items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))
        lines = [f"{'phase':<10} {'collective':<15} {'axes':<12} {'count':>6} {'bytes':>12}"]
        for (kind, axes, phase), e in rows:
            lines.append(f"{phase:<10} {kind:<15} {','.join(axes):<12} {e['count']:>6} {int(e['bytes']):>12}")
        return "\n".join(lines)


def count_step(model, optimizer, tokens, labels, mesh, *, step: bool = True) -> CommCounter:
    """Run one training step (forward, backward, ``optimizer.step()``) under a
    :class:`CommCounter` and return it.  ``tokens``/``labels`` are this rank's local slices."""
    cc = CommCounter(mesh)
    with cc:
        with cc.phase("forward"):
            loss = model(tokens, labels)
        loss.backward()
        if step:
            with cc.phase("optimizer"):
                optimizer.step()
    optimizer.zero_grad()
    return cc
