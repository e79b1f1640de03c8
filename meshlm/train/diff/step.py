"""One training step, recorded: what a side of ``meshlm diff`` runs.

``capture_step(model, opt, micro_batches)`` runs the step ``meshlm train`` runs (NOTE [token
weighting] in meshlm/core/weighting.py for how the micro-batches combine; meshlm/train/step.py)
and records, in this order (NOTE [diff capture] in meshlm/train/diff/capture.py):

* ``init``: every parameter before the step (both sides must start from the same weights);
* ``block`` and ``constrain``: the forward, as it runs;
* ``loss``: the step's loss (the micro-batches' losses combined by their weights);
* ``grad``: the gradient the optimizer steps with, per parameter: after the step's
  reduction (ZeRO-1/2 reduce at the step) and the micro-batch rescaling, before clipping;
  in the order backward makes them, as far as the forward tells (``Recorder.backward_order``:
  the reverse of the order the modules' first calls returned; the order of the math, not
  of a layout's reductions, so that it is the same on both sides);
* ``norm``: the global gradient norm clipping sees;
* ``param``: every parameter after the step.

The gradient the optimizer steps with is a master's (``ShardedOptimizer.masters``): the
parameter itself, or its float32 master under mixed precision, named by the parameter.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshlm.core.annotate import param_axes_of
from meshlm.core.rng import seed_forward
from meshlm.core.weighting import Accumulation, rescale
from meshlm.train.diff.capture import Recorder, full_value, shard_state_or_none
from meshlm.train.diff.record import PHASE, Capture, Record


def param_records(kind: str, model: nn.Module) -> list[Record]:
    """Every parameter of ``model`` (each tied one once), gathered, as ``kind`` records in
    registration order; a parameter another pipeline stage holds is left out."""
    from meshlm.runtime.absent import Absent

    st = shard_state_or_none(model)
    axes = param_axes(model)
    out = []
    for fqn, p in model.named_parameters():
        if isinstance(p, Absent):
            continue
        module, _, name = fqn.rpartition(".")
        value, pl = full_value(p.detach(), st, None)
        out.append(Record(kind, module, name, axes.get(fqn), pl, value))
    return out


def param_axes(model: nn.Module) -> dict[str, tuple]:
    """The logical axes each parameter FQN is declared with (``param_axes``, ``set_axes``)."""
    out = {}
    for path, m in model.named_modules():
        for name, ax in param_axes_of(m).items():
            out[f"{path}.{name}" if path else name] = tuple(ax)
    return out


def optimizer_meta(opt) -> dict[str, Any]:
    """Which update rule the optimizer runs and its hyperparameters (what the comparison
    propagates the gradient bounds through: NOTE [tolerances after steps] in
    meshlm/train/tolerances.py)."""
    inner = getattr(opt, "inner", opt)
    kind = {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}.get(type(inner), type(inner).__name__)
    g = inner.param_groups[0]
    hp = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "momentum") if k in g}
    if "betas" in hp:
        hp["betas"] = [float(b) for b in hp["betas"]]
    return {"optimizer": kind, "hp": {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in hp.items()}}


def capture_step(
    model: nn.Module,
    opt,
    micro_batches: list[tuple[tuple, dict]],
    *,
    seed: int = 0,
    step: int = 1,
    grad_clip: float = 0.0,
    loss_of: Optional[Callable[[Any], Tensor]] = None,
    meta: Optional[dict] = None,
    blocks: Optional[set[str]] = None,
    pipeline: Any = None,
) -> Capture:
    """Run one training step of the sharded ``model`` with its ``ShardedOptimizer`` ``opt``
    and record it (module docstring).  ``micro_batches``: this rank's ``(args, kwargs)`` of
    each micro-batch (``model(*args, **kwargs)``); ``loss_of(output)`` picks the scalar loss
    (default: the output itself); each micro-batch's forward starts from torch's generators
    seeded by (``seed``, ``step``, micro-batch), as ``meshlm train`` does; ``grad_clip``: the
    global norm clipped to (0: none); ``blocks``: the module paths whose outputs to record
    (default: every ``@meshlm.block``).  ``opt`` may be a :class:`PlainOptimizer` for a plain
    model on one process.  ``pipeline``: the ``meshlm.runtime.pipeline.Pipeline`` whose
    ``model`` this is (``opt`` attached to it), whose schedule then runs the micro-batches;
    each stage records its own tensors, and every rank gets every stage's.  Every rank must
    call it; every rank gets the whole capture (``meta`` added to its own)."""
    rec = Recorder(model, blocks)
    records = param_records("init", model)
    with rec.watching():
        if pipeline is None:
            loss = _one_by_one(model, opt, micro_batches, seed, step, loss_of)
        else:
            loss = _through(pipeline, micro_batches, seed, step)
    records += rec.records(len(micro_batches))
    records.append(Record("loss", "", "loss", (), "whole", torch.tensor(loss, dtype=torch.float64)))
    opt.reduce_grads()
    norm = opt.grad_norm()
    st = shard_state_or_none(model)
    axes = param_axes(model)
    masters = opt.masters()
    for fqn in rec.backward_order(list(masters)):
        g = masters[fqn].grad
        if g is None:  # no loss reached it (NOTE [unused parameters] in meshlm/runtime/unused.py)
            continue
        module, _, name = fqn.rpartition(".")
        value, pl = full_value(g, st, None)
        records.append(Record("grad", module, name, axes.get(fqn), pl, value))
    records.append(Record("norm", "", "grad norm", (), "whole", norm.detach().double().cpu().reshape(())))
    if grad_clip > 0:
        opt.clip_grad_norm_(grad_clip, norm)
    opt.step()
    records += param_records("param", model)
    opt.zero_grad()
    if pipeline is not None:
        records = _stages_together(pipeline, records)
    info = {
        "world": st.mesh.size() if st is not None else 1,  # the most ranks a sum is split over
        "processes": dist.get_world_size() if dist.is_initialized() else 1,
        "grad_accum": len(micro_batches),
        "grad_clip": float(grad_clip),
        "compute_dtype": str(getattr(st, "compute_dtype", None) or _dtype_of(model)).removeprefix("torch."),
        **optimizer_meta(opt),
        **(meta or {}),
    }
    return Capture(records, info)


def _one_by_one(model: nn.Module, opt, micro: list, seed: int, step: int, loss_of) -> float:
    """Each micro-batch's forward and backward in turn, weighted as ``meshlm train`` weighs
    them (meshlm/train/step.py, ``accumulate``); the step's loss."""
    acc = Accumulation(len(micro))
    for j, (args, kwargs) in enumerate(micro):
        seed_forward(seed, step, j)
        out = model(*args, **kwargs)
        loss = out if loss_of is None else loss_of(out)
        (loss * acc.coefficient(loss)).backward()
    rescale(acc.grad_factor(), opt)
    return acc.loss()


def _through(pipe, micro: list, seed: int, step: int) -> float:
    """The micro-batches through the pipeline's schedule, each stage's forward of micro-batch
    j from the generator state seeded by (``seed``, ``step``, j), as ``meshlm train`` runs a
    pipelined step (``Pipeline.passes``); the step's loss, the gradients weighted."""
    starts = []
    for j in range(len(micro)):
        seed_forward(seed, step, j)
        starts.append(torch.get_rng_state())
    pipe.mbs.starts = starts
    try:
        return pipe.step([(tuple(a), kw) for a, kw in micro])
    finally:
        pipe.mbs.starts = None


def _stages_together(pipe, records: list[Record]) -> list[Record]:
    """Every stage's records on every rank (one all-gather over the world, each stage's
    records from its first rank), in the step's order: each phase stage after stage, the
    gradients from the last stage back (backward's order)."""
    stages = sorted(sm.stage for sm in pipe.stage_modules)
    first = all(c == 0 for c in (pipe.sub.get_coordinate() or ()))
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (stages[0], records if first else None))
    parts = sorted((g for g in got if g[1] is not None), key=lambda g: g[0])
    out, seen = [], set()
    for phase in sorted(set(PHASE.values())):
        for _s, recs in reversed(parts) if phase == PHASE["grad"] else parts:
            for r in recs:
                if PHASE[r.kind] == phase and r.key not in seen:
                    seen.add(r.key)
                    out.append(r)
    return out


def _dtype_of(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class PlainOptimizer:
    """A torch optimizer over a plain model on one process, with the methods of
    ``ShardedOptimizer`` that ``capture_step`` calls: the other implementation of a diff
    (a ``transformers`` model) steps through it as a sharded model steps through its own."""

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer):
        self.model = model
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    def masters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def reduce_grads(self) -> None:
        pass

    def scale_grads(self, factor: float) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def grad_norm(self) -> Tensor:
        """The global L2 norm, accumulated in float64 as ``ShardedOptimizer.grad_norm`` does."""
        sq = [p.grad.double().pow(2).sum() for p in self.model.parameters() if p.grad is not None]
        return torch.stack(sq).sum().sqrt().float() if sq else torch.zeros(())

    def clip_grad_norm_(self, max_norm: float, norm: Optional[Tensor] = None) -> Tensor:
        total = self.grad_norm() if norm is None else norm
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if coef < 1.0:
            self.scale_grads(coef)
        return total

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)
