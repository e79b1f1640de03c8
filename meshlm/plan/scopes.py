"""``meshlm plan`` per scope of a scoped layout (NOTE [scoped layouts] in meshlm/core/scopes.py).

NOTE [planned scopes]
    For a layout with scopes the plan adds, per scope (and ``top level`` for the parameters
    under no scope), per rank:

    - ``memory``: the model state its parameters hold (``params``, ``grads``,
      ``optimizer``), measured on the fake step's sharded model and optimizer
      (``state_by_scope``), each storage counted once as in ``model_state_bytes``;
    - ``comm``: the parameter traffic its rules imply, per (kind, mesh axis, phase), in
      logical bytes (the tensor each rank passes), from the per-parameter plans
      (``traffic_by_scope``).  With c the bytes of a parameter as compute uses it:
        storage shards it over a data axis compute does not (ZeRO-3): an all-gather of c
        in forward, another in backward when it lies in a block (only blocks re-gather);
        compute splits the batch over a data axis that the parameter's compute placement
        does not shard: its gradient is a partial sum there, reduce-scattered (c) where
        the gradient placement shards that axis, else all-reduced (c, divided by the
        axes already reduce-scattered: HSDP's all-reduce of the shard);
        ``grads: local`` (ZeRO-1): the reduce-scatter and the all-gather at the step,
        over the optimizer's data axes; gradients sharded where storage is not (ZeRO-2):
        the updated shard all-gathered at the step.
      Activation collectives (tensor parallel, the loss) are the model's, not a scope's,
      and stay in the counted table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping

import torch

from meshlm.core.axes import DATA_AXES
from meshlm.core.scopes import scope_of

TOP = "top level"


def scope_label(layout: Any, fqn: str) -> str:
    """The scope path ``fqn`` lies under, or ``TOP``."""
    sc = scope_of(layout, fqn)
    return TOP if sc is None else sc.path


def state_by_scope(model: Any, opt: Any, layout: Any) -> dict[str, dict[str, int]]:
    """Per scope, this rank's ``params``, ``grads`` and ``optimizer`` bytes."""
    from meshlm.runtime.memory import storage_bytes

    masters = opt.masters() if hasattr(opt, "masters") else {}
    inner = getattr(opt, "inner", opt)
    groups: dict[str, list] = defaultdict(list)
    for fqn, p in model.named_parameters():
        groups[scope_label(layout, fqn)].append((fqn, p))
    out: dict[str, dict[str, int]] = {k: {} for k in groups}
    seen: set[int] = set()  # in model_state_bytes' order: parameters, then gradients, then state
    for label, items in groups.items():
        out[label]["params"] = storage_bytes([p for _f, p in items], seen)
    for label, items in groups.items():
        ms = [masters[f] for f, _p in items if f in masters]
        grads = [p.grad for _f, p in items] + [getattr(p, "main_grad", None) for _f, p in items]
        out[label]["grads"] = storage_bytes(grads + [m.grad for m in ms], seen)
    for label, items in groups.items():
        ms = [masters[f] for f, _p in items if f in masters]
        state = [v for m in ms for v in inner.state.get(m, {}).values() if torch.is_tensor(v)]
        out[label]["optimizer"] = storage_bytes(ms + state, seen)
    return out


def traffic_by_scope(
    plans: Mapping[str, Any], layout: Any, sizes: Mapping[str, int], in_block: set[str], elt: int = 4
) -> dict[str, dict[tuple, int]]:
    """Per scope, (kind, (mesh axis,), phase) -> logical bytes per rank per step of its
    parameters' gathers and gradient reductions (NOTE [planned scopes]); ``plans``: FQN ->
    ParamPlan, ``in_block``: the FQNs inside blocks, ``elt``: bytes per element."""
    out: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    live = [a for a in DATA_AXES if sizes.get(a, 1) > 1]
    for fqn, pp in plans.items():
        lay, t = layout.for_path(fqn), out[scope_label(layout, fqn)]
        c = math.prod(pp.local_shape(pp.compute, sizes)) * elt
        comp = {a for axes in pp.compute for a in axes}
        stored = {a for axes in pp.storage for a in axes}
        for a in live:
            if a in stored and a not in comp:  # ZeRO-3: gathered at use
                t[("all_gather", (a,), "forward")] += c
                if fqn in in_block:
                    t[("all_gather", (a,), "backward")] += c
        batch = [a for a in lay.compute.get("batch", ()) if a in live and a not in comp]
        if pp.grads is None:  # grads: local (ZeRO-1): reduced at the step, the update gathered back
            opt = {a for axes in pp.optimizer for a in axes}
            for a in batch:
                if a in opt:
                    t[("reduce_scatter", (a,), "optimizer")] += c
                    t[("all_gather", (a,), "optimizer")] += c
            continue
        grads = {a for axes in pp.grads for a in axes}
        for a in live:
            if a in grads and a not in stored and a not in comp:  # ZeRO-2: the update gathered back
                t[("all_gather", (a,), "optimizer")] += c
        scattered = 1
        for a in sorted(batch, key=lambda a: a not in grads):  # reduce-scatters first, then all-reduces
            if a in grads:
                t[("reduce_scatter", (a,), "backward")] += c
                scattered *= sizes[a]
            else:
                t[("all_reduce", (a,), "backward")] += c // scattered
    return {k: dict(v) for k, v in out.items()}


def plan_scopes(build: Any, layout: Any, sizes: Mapping[str, int], state: Mapping[str, dict], elt: int) -> dict:
    """The ``scopes`` entry of a Plan: per scope its measured ``memory`` (``state``, from
    ``state_by_scope``) and planned ``comm`` (``traffic_by_scope``, keys as strings)."""
    from meshlm.core.annotate import outer_blocks
    from meshlm.runtime.lowering import plan_params

    model = build("meta")
    inside = {id(p) for b in outer_blocks(model) for p in b.parameters()}
    in_block = {fqn for fqn, p in model.named_parameters() if id(p) in inside}
    traffic = traffic_by_scope(plan_params(model, layout, sizes), layout, sizes, in_block, elt)
    labels = [*(s.path for s in layout.scopes), TOP]
    return {
        k: {
            "memory": dict(state.get(k, {"params": 0, "grads": 0, "optimizer": 0})),
            "comm": {f"{kind} {axes[0]} {phase}": b for (kind, axes, phase), b in sorted(traffic.get(k, {}).items())},
        }
        for k in labels
        if k in state or k in traffic
    }
