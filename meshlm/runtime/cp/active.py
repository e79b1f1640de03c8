"""Which model's ``context`` settings are in force on a mesh: each sharded model's own, while
its forward and its backward run (meshlm/_torch_compat/dtensor_cp.py keeps the table).

NOTE [cp settings per model]
    meshlm's DTensor rules find a mesh's cp settings (``context.attention``, ``.balance``) by
    the mesh's value, since DTensor does not tell equal meshes apart (NOTE [scoped patches]
    in meshlm/_torch_compat/dtensor_scope.py).  Two live models on equal meshes (the same
    shape and dim names) may have different ``context`` sections, so each model carries its
    own entry and puts it in force where its work runs:

    - its root forward puts it in force on entry (``enter_forward``), and leaves it there:
      what the caller then does with the outputs (a loss, a gather of the logits) runs
      under it too;
    - every output of the root that needs a gradient gets a hook that puts it in force when
      backward reaches that output (``_on_backward``), before any of the model's own
      backward runs: its attention backward, its redistributes, and the forward that
      activation checkpointing recomputes.

    ``attention`` (ring or all-gather) changes only how keys and values travel: both are
    exact, so attention run with the other model's variant gives the same values.
    ``balance`` changes what a split over cp *means* for every DTensor on the mesh (NOTE
    [balanced chunks]), and a DTensor does not say which model made it.  So where two live
    models on equal meshes differ in ``balance``, what could run under the other model's
    settings is refused with a ConfigError that names both:

    - an output of a root split over cp (the caller could move it while the other model is
      in force): refused when it is returned, or when the second model is sharded if the
      first has returned one;
    - one backward pass through both models (``(loss_a + loss_b).backward()``): the engine
      interleaves their nodes, so no hook can keep each node's settings; refused when the
      second model's hook runs;
    - both models' blocks compiled: every layer of a block class runs one compiled graph
      (NOTE [static block shapes] in meshlm/runtime/compile.py), traced under the first
      model's balance; refused at the second model's forward.
"""

from __future__ import annotations

import functools
import gc

import torch
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm._torch_compat import dtensor_cp
from meshlm.core import tree
from meshlm.core.errors import ConfigError

# The entries whose backward hooks ran in the backward pass running now: (graph task id, entries)
_OPEN: dict = {"task": None, "specs": []}


def settings(spec: dtensor_cp.CpMesh) -> str:
    return f"{spec.owner} (context: attention {spec.variant}, balance {str(spec.balance).lower()})"


_FIX = (
    "give both layouts the same context.balance, shard one model onto a mesh of other sizes or dim names, or "
    "free the first model (del it) before sharding the second (NOTE [cp settings per model] in "
    "meshlm/runtime/cp/active.py; docs/cp.md)"
)


def clashes(spec: dtensor_cp.CpMesh) -> list[dtensor_cp.CpMesh]:
    """The other live models on meshes equal to ``spec``'s with another ``balance``."""
    return [m for m in dtensor_cp.registered(spec.mesh) if m is not spec and m.balance != spec.balance]


def register(spec: dtensor_cp.CpMesh) -> None:
    """Register ``spec`` (a model being sharded), refusing it where a live model on an equal
    mesh with another balance has returned outputs split over cp (NOTE [cp settings per model])."""
    if any(m.split_outputs for m in clashes(spec)):
        gc.collect()  # a model freed by its user but held by a reference cycle is not in the way
    for other in clashes(spec):
        if other.split_outputs:
            raise ConfigError(
                f"meshlm.shard: {settings(spec)} on a mesh equal to that of a live model sharded with "
                f"{settings(other)}, whose forward has returned an output split over cp: that output's order "
                "depends on its model's balance and would be moved under the new model's; " + _FIX
            )
    dtensor_cp.register(spec)


def enter_forward(spec: dtensor_cp.CpMesh) -> None:
    """The model of ``spec`` starts its root forward: its settings in force."""
    if spec.compiled:
        for other in clashes(spec):
            if other.compiled:
                raise ConfigError(
                    f"two compiled models on equal meshes with different context.balance: {settings(spec)} and "
                    f"{settings(other)}; their blocks run the same compiled graphs, traced under one balance; " + _FIX
                )
    dtensor_cp.activate(spec)


def leave_forward(spec: dtensor_cp.CpMesh, out):
    """The model of ``spec`` returns ``out``: note an output split over cp (refused where
    another live model on an equal mesh has another balance) and hook every output that needs
    a gradient, so that backward runs under this model's settings."""

    def visit(path: str, t):
        if isinstance(t, DTensor) and dtensor_cp.is_split(t.placements[spec.index]):
            spec.split_outputs = True
            other = clashes(spec)
            if other:
                raise ConfigError(
                    f"the forward of the model sharded with {settings(spec)} returns {path or 'its output'} split "
                    f"over cp, while a live model sharded with {settings(other[0])} is on an equal mesh: the output's "
                    "order depends on its model's balance and could be moved under the other's; return a loss (or "
                    "gather the output inside the forward), or " + _FIX
                )
        if t.requires_grad and not torch.compiler.is_compiling():
            t.register_hook(functools.partial(_on_backward, spec))
        return t

    tree.map_tensors(out, visit, strict=False)


def _on_backward(spec: dtensor_cp.CpMesh, grad):
    """Backward reaches an output of ``spec``'s model: its settings in force, unless this
    backward pass has run into a model with another balance on an equal mesh already."""
    task = compat.backward_task_id()
    if _OPEN["task"] != task:
        _OPEN["task"], _OPEN["specs"] = task, []
    clash = [m for m in clashes(spec) if any(m is o for o in _OPEN["specs"])]
    if clash:
        raise ConfigError(
            f"one backward pass runs through two models on equal meshes with different context.balance, "
            f"{settings(clash[0])} and {settings(spec)}: the autograd engine interleaves their nodes, and each "
            "node must run under its own model's balance; call backward on each model's loss in turn, or " + _FIX
        )
    if spec not in _OPEN["specs"]:
        _OPEN["specs"].append(spec)
    dtensor_cp.activate(spec)
    return None
