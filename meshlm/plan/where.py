"""Where the planner's fake step stopped, told in the model's terms: the module path, the
operation, the line of the model's code, the layout and mesh, and what to do.

NOTE [unmeasurable step]
    A step that runs for real may not run on fake tensors (NOTE [fake measurement] in
    measure.py): an op that reads a value back to Python (``.item()``, ``int(t)``), an
    output whose shape depends on the data (boolean indexing, ``nonzero``), an op with no
    fake kernel.  Torch reports these as ``DataDependentOutputException`` and its kin, often
    wrapped by DTensor in a ``RuntimeError`` ("Sharding propagation failed for ...") whose
    traceback names no line of the model.  :class:`Where` follows the step as it runs
    (the module being run: in forward by hooks on each of the model's modules, in backward
    by hooks on the autograd nodes of each module's outputs, where backward enters it, and
    of its inputs, where it leaves; the phase; the aten op that raised, by
    :meth:`Where.op_failed`), and :func:`unmeasurable` turns
    such an exception, wherever in its chain of causes torch's fake-tensor exception sits,
    into a ConfigError that names them.  Any other exception passes through unchanged.
"""

from __future__ import annotations

import re
import traceback
from typing import Optional

import torch

from meshlm import _torch_compat as compat
from meshlm.core.errors import ConfigError, is_model_code


class Where:
    """The module the step is running (its path in the model), the phase and the first op
    that raised: attach with :meth:`attach` while the step runs."""

    def __init__(self):
        self.stack: list[str] = []
        self.phase = "forward"
        self.op: Optional[str] = None
        self._handles: list = []
        self.classes: dict[str, type] = {}

    def attach(self, model: torch.nn.Module) -> "Where":
        for path, m in model.named_modules():
            self.classes[path] = type(m)
            self._handles.append(m.register_forward_pre_hook(self._enter(path)))
            self._handles.append(m.register_forward_hook(self._leave))
        return self

    def _enter(self, path: str):
        def hook(_module, args) -> None:  # returns None: the module's inputs stay as they are
            self.stack.append(path)
            for node in _nodes(args):  # backward reaches the inputs' nodes when it leaves the module
                node.register_prehook(lambda _grads: self._drop(path))

        return hook

    def _leave(self, module, _args, out) -> None:
        path = self.stack.pop() if self.stack else ""
        for node in _nodes(out):  # backward enters the module at its outputs' nodes
            node.register_prehook(lambda _grads, p=path: self.stack.append(p))

    def _drop(self, path: str) -> None:
        if path in self.stack:
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(path)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def op_failed(self, func) -> None:
        """Called by the step's dispatch mode when ``func`` raised (the first one counts)."""
        if self.op is None:
            self.op = str(func)

    def forward_line(self) -> Optional[str]:
        """Where the running module's forward is defined (in backward, no line of it runs)."""
        import inspect

        cls = self.classes.get(self.stack[-1]) if self.stack else None
        try:
            fn = getattr(cls, "forward")
            return f"{cls.__name__}.forward, {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
        except (AttributeError, OSError, TypeError):
            return None

    @property
    def module(self) -> str:
        path = self.stack[-1] if self.stack else None
        return f"module `{path}`" if path else "the model's top level"


def _nodes(x) -> list:
    """The autograd nodes of the tensors in ``x`` (a module's inputs or outputs)."""
    return [t.grad_fn for t in compat.tree_leaves(x) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _fake_cause(e: BaseException) -> Optional[BaseException]:
    """The fake-tensor exception in ``e``'s chain of causes, or None."""
    kinds = compat.fake_unsupported_errors()
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kinds):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _user_line(e: BaseException) -> Optional[str]:
    """The innermost frame of ``e``'s traceback outside torch and meshlm: the model's line."""
    for f in reversed(traceback.extract_tb(e.__traceback__)):
        if is_model_code(f.filename):
            return f"{f.filename}:{f.lineno}" + (f" `{f.line.strip()}`" if f.line else "")
    return None


class Unmeasurable(ConfigError):
    """A step that cannot run on fake tensors (NOTE [unmeasurable step])."""


def unmeasurable(e: BaseException, where: Where, layout: str, mesh: dict) -> Optional[Unmeasurable]:
    """The error for an exception the fake step raised because it needs real data
    (NOTE [unmeasurable step]), or None for any other exception."""
    cause = _fake_cause(e)
    if cause is None:
        return None
    op = where.op
    m = re.search(r"Sharding propagation failed for (\S+?)\(", str(e))
    if m:  # DTensor's own op, whose sharding rule needed the data: name it, not the inner aten op
        op = m.group(1)
    op = op or str(getattr(cause, "func", "") or "") or "an op"
    line = _user_line(e) if where.phase == "forward" else where.forward_line()
    if m:
        why = "DTensor's sharding rule for it reads sizes back from a tensor, which a fake tensor cannot"
        fix = "plan another layout (layout=auto leaves this one out), or write the op another way (attention: F.scaled_dot_product_attention)"
    elif "_local_scalar_dense" in op:
        why = "it reads a tensor's value back to Python (int(t), float(t), t.item()), which a fake tensor has not"
        fix = "keep the value a tensor (divide by the tensor, not by int(t)), or pass it in as a Python number"
    else:
        why = "its output's shape depends on the data (boolean indexing, nonzero, unique) or it has no fake kernel"
        fix = "write it with fixed shapes (a weighted sum with a mask, torch.where), or plan another layout"
    return Unmeasurable(
        f"meshlm plan could not measure layout {layout} on mesh {mesh}: {where.module} runs {op} in "
        f"{where.phase}{f' at {line}' if line else ''}, and {why} ({type(cause).__name__}). What to do: {fix}. "
        "The run may still train: meshlm train measures its memory as it runs"
    )
