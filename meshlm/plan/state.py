"""Model-state memory (parameters, gradients, optimizer state) from the lowering's
per-parameter plans, beside the ZeRO formula; model-agnostic (NOTE [plan = lowering])."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from meshlm.core.axes import DATA_AXES
from meshlm.layout.rules import Layout
from meshlm.models import Llama, LlamaConfig, llama_config
from meshlm.runtime.lowering import ParamPlan, plan_params


def _local_numel(pp: ParamPlan, plan, sizes: Mapping[str, int]) -> int:
    return math.prod(pp.local_shape(plan, sizes))


def _prod(axes, sizes) -> int:
    return math.prod(sizes.get(a, 1) for a in axes)


def _master_is_view(pp: ParamPlan, sizes: Mapping[str, int]) -> bool:
    """A same-dtype master is a view of the parameter (optim_chunks.py ``shard_view``) when the
    optimizer placements only split further what storage keeps: per tensor dim, the
    storage's active axes are the leading ones of the optimizer's, and no axis moves to
    another dim."""

    def active(plan):
        return [tuple(a for a in axes if sizes.get(a, 1) > 1) for axes in plan]

    st, op = active(pp.storage), active(pp.optimizer)
    dim_of = {a: d for d, axes in enumerate(op) for a in axes}
    return all(s == o[: len(s)] for s, o in zip(st, op)) and all(
        dim_of.get(a, d) == d for d, axes in enumerate(st) for a in axes
    )


def _dimplan_axes(plan) -> set[str]:
    return {a for axes in plan for a in axes}


def model_config(model: "str | LlamaConfig | tuple[str, LlamaConfig]") -> tuple[str, LlamaConfig]:
    """(name, config) from a config name, a LlamaConfig, or a (name, LlamaConfig) pair."""
    if isinstance(model, tuple):
        return model
    if isinstance(model, LlamaConfig):
        return "custom", model
    return model, llama_config(model)


_PLAN_CACHE: dict = {}
_MODELS: dict = {}  # one one-layer meta model per config


@dataclass(frozen=True)
class _Param:
    """One parameter's plan and how many identical copies the model holds (every layer's
    parameters are planned once, on layer 0, and counted ``L`` times)."""

    plan: ParamPlan
    count: int
    in_block: bool
    name: str  # the FQN with ``layers.<i>.`` removed


def _param_plans(cfg: LlamaConfig, layout: Layout, sizes: dict[str, int]) -> list[_Param]:
    """Per-parameter plans, each distinct parameter planned once.

    NOTE [one layer]: every block of our Llama has the same parameters (names, shapes,
    axes), so planning layer 0 of a one-layer model and counting it ``layers`` times gives
    the plans of the whole model; planning cost is independent of depth."""
    key = (cfg, layout.source, layout.name, tuple(sorted(sizes.items())))
    if key not in _PLAN_CACHE:
        one = replace(cfg, layers=1)
        if one not in _MODELS:
            _MODELS[one] = Llama(one, device="meta")
        out = []
        for fqn, pp in plan_params(_MODELS[one], layout, sizes).items():
            in_block = fqn.startswith("layers.")
            out.append(_Param(pp, cfg.layers if in_block else 1, in_block, fqn.split(".", 2)[2] if in_block else fqn))
        if len(_PLAN_CACHE) > 4096:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = out
    return _PLAN_CACHE[key]


def _regathers(pp: ParamPlan, sizes: Mapping[str, int]) -> bool:
    """Gathered over a data axis at use (lowering/params.py ``needs_regather``, on active axes)."""
    return any(
        a in DATA_AXES and a not in c and sizes.get(a, 1) > 1 for s_, c in zip(pp.storage, pp.compute) for a in s_
    )


def _held_gathered(params_: list[_Param], sizes: Mapping[str, int], regather: bool, B: int, cast: bool) -> int:
    """Bytes of at-use copies of parameters that autograd keeps from forward to backward.

    A parameter whose compute placements differ from its storage, or every parameter when
    ``cast`` (the compute dtype differs from the storage's), is redistributed or cast (a
    new tensor of ``B`` bytes per element) at use, and ``F.linear``/the norm's multiply save
    that copy for backward.  Block
    parameters gathered over a data axis are not kept (NOTE [re-gather in backward]); the
    embedding table is not kept either (``F.embedding`` saves only the token ids), unless it
    is tied to the output head."""
    out = 0
    for prm in params_:
        pp = prm.plan
        if not cast and [[a for a in d if sizes.get(a, 1) > 1] for d in pp.compute] == [
            [a for a in d if sizes.get(a, 1) > 1] for d in pp.storage
        ]:
            continue  # used as stored: the saved tensor is (a view of) the parameter
        if prm.in_block and regather:
            continue
        if prm.name == "tok_emb" and any(p.name == "lm_head" for p in params_):
            continue
        out += prm.count * _local_numel(pp, pp.compute, sizes) * B
    return out


def _shard_n(lay: Layout, sizes: Mapping[str, int]) -> int:
    """Ranks the model state is sharded over on the data axes (ZeRO's N)."""
    rules = lay.optimizer_rules
    axes = {a for v in rules.values() for a in v if a in DATA_AXES and sizes.get(a, 1) > 1}
    return _prod(sorted(axes), sizes)


def _batch_axes(lay: Layout, sizes: Mapping[str, int]) -> list[str]:
    return [a for a in lay.compute.get("batch", ()) if sizes.get(a, 1) > 1]


def _zero_formula(lay: Layout, psi: int, n: int, t: int, B: int, MB: int, GB: Optional[int] = None) -> dict[str, Any]:
    """ZeRO-paper model-state bytes per rank for this layout's stage, TP dividing by t.
    (Uses Ψ of the whole model; replicated norms make the exact figure a little larger.)
    ``GB``: main gradients of that many bytes (NOTE [main grads]), None: none."""
    stage = {"zero1": 1, "zero2": 2}.get(lay.name)
    if stage is None:
        stage = 3 if any(a in DATA_AXES for v in lay.params.values() for a in v) else 0
    nn_ = max(n if stage else 1, 1)
    # hsdp shards over fsdp only
    p = psi / t
    params = p * B / (nn_ if stage == 3 else 1)
    if GB is not None:  # main gradients become the master's: no second buffer
        grads = p * GB / (nn_ if stage >= 2 else 1)
    else:
        grads = p * B / (nn_ if stage >= 2 else 1) + (p * MB / nn_ if MB != B else 0)  # + the master's grad
    opt = p * (2 * MB) / (nn_ if stage >= 1 else 1) + (p * MB / nn_ if (stage in (1, 2) or MB != B) else 0)
    gtext = (
        f"main grads {GB}Ψ/{'N' if stage >= 2 else '1'}"
        if GB is not None
        else f"grads {B}Ψ/{'N' if stage >= 2 else '1'}{f' + master grads {MB}Ψ/N' if MB != B else ''}"
    )
    return {
        "stage": stage,
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "text": f"ZeRO-{stage}: params {B}Ψ/{'N' if stage == 3 else '1'}, {gtext}, "
        f"Adam {2 * MB}Ψ/{'N' if stage >= 1 else '1'} (+ master {MB}Ψ/N if separate), Ψ/t with t={t}",
    }
