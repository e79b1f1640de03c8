"""Values that live on another pipeline stage: ``Absent`` tensors, shapes without data.

NOTE [absent values]
    Under pipeline parallelism (meshlm/runtime/pipeline/) every stage runs the model's own forward,
    unchanged, from its first line to its last, so that the model needs no stage-aware
    code.  What belongs to other stages runs on ``Absent`` tensors: a parameter that
    another stage holds is an ``Absent`` attribute of its module (a meta tensor of the
    parameter's shape and dtype, never a ``Parameter``), and so is what a stage receives
    from before its first block's input is spliced in, and what follows its last block's
    output.  Any torch function that sees an ``Absent`` argument runs on the meta device
    (every other tensor argument replaced by a meta tensor of its shape and dtype; a
    DTensor by one of its global shape) and returns ``Absent`` results: shapes and dtypes
    propagate, no data is touched, no collective runs.  So a stage computes for real
    exactly what depends only on what it holds, and the Python of the rest of the forward
    still runs (in particular, ``meshlm.dropout`` still draws its key from torch's
    generator in one-device order: NOTE [dropout keys] in meshlm/core/rng.py).

    Reading an ``Absent`` value's data (``.item()``, ``bool()``, ``.tolist()``) fails: the
    value is on another stage.  ``check_real`` turns an ``Absent`` where real data is
    needed (a block's side input, a loss) into an error that names it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.state import RUN

__all__ = ["Absent", "absent_like", "has_absent", "is_absent"]


class Absent(Tensor):
    """A tensor whose data lives on another pipeline stage (NOTE [absent values])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # the run state's ``on_use``, set only while meshlm.runtime.pipeline.cut.probe runs: it
        # sees the leaves of every torch call with an Absent argument (which parameters each segment uses)
        on_use = RUN.on_use
        if on_use is not None:
            on_use(compat.tree_leaves((args, kwargs or {})))
        # shapes on the meta device, outside the planner's FakeTensorMode if one is active
        with compat.outside_fake():
            a, k = compat.tree_map(_to_meta, (args, kwargs or {}))
            with compat.no_torch_function_subclass():
                out = func(*a, **k)
            return compat.tree_map(_to_absent, out)

    def __repr__(self) -> str:  # no data to print
        return f"Absent(shape={tuple(self.shape)}, dtype={self.dtype})"


def _to_meta(x: Any) -> Any:
    if isinstance(x, Absent):
        return x.as_subclass(Tensor)
    if isinstance(x, Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _to_absent(x: Any) -> Any:
    return x.as_subclass(Absent) if isinstance(x, Tensor) and x.device.type == "meta" else x


def absent_like(t: Tensor) -> Absent:
    """An ``Absent`` of ``t``'s shape and dtype (a DTensor's global shape)."""
    if isinstance(t, Absent):
        return t
    with compat.outside_fake(), compat.no_torch_function_subclass():
        m = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return m.as_subclass(Absent)


def is_absent(x: Any) -> bool:
    return isinstance(x, Absent)


def has_absent(tree: Any) -> bool:
    """Whether any leaf of ``tree`` (nested lists, tuples, dicts) is ``Absent``."""
    return any(isinstance(x, Absent) for x in compat.tree_leaves(tree))


def absent_params(model) -> dict[str, Tensor]:
    """FQN -> ``Absent`` of the parameters another pipeline stage holds (the ``Absent``
    attributes ``meshlm.shard(..., keep=...)`` left in their modules' place)."""
    out: dict[str, Tensor] = {}
    for mname, m in model.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, Absent):
                out.setdefault(f"{mname}.{k}" if mname else k, v)
    return out
