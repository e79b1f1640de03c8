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
from torch import Tensor, nn

from meshlm.core.rng import seed_forward
from meshlm.core.weighting import Accumulation, rescale
from meshlm.train.diff.capture import Recorder, full_value, shard_state_or_none
from meshlm.train.diff.record import Capture, Record


def param_records(kind: str, model: nn.Module) -> list[Record]:
    """Every parameter of ``model`` (each tied one once), gathered, as ``kind`` records in
    registration order; a parameter another pipeline stage holds is left out."""
    from meshlm.runtime.absent import Absent

    st = shard_state_or_none(model)
    out = []
    for fqn, p in model.named_parameters():
        if isinstance(p, Absent):
            continue
        module, _, name = fqn.rpartition(".")
        value, pl = full_value(p.detach(), st, None)
        out.append(Record(kind, module, name, None, pl, value))
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
) -> Capture:
    """Run one training step of the sharded ``model`` with its ``ShardedOptimizer`` ``opt``
    and record it (module docstring).  ``micro_batches``: this rank's ``(args, kwargs)`` of
    each micro-batch (``model(*args, **kwargs)``); ``loss_of(output)`` picks the scalar loss
    (default: the output itself); each micro-batch's forward starts from torch's generators
    seeded by (``seed``, ``step``, micro-batch), as ``meshlm train`` does; ``grad_clip``: the
    global norm clipped to (0: none); ``blocks``: the module paths whose outputs to record
    (default: every ``@meshlm.block``).  ``opt`` may be a :class:`PlainOptimizer` for a plain
    model on one process.  Every rank must call it; every rank gets the whole capture
    (``meta`` added to its own)."""
    rec = Recorder(model, blocks)
    records = param_records("init", model)
    acc = Accumulation(len(micro_batches))
    with rec.watching():
        for j, (args, kwargs) in enumerate(micro_batches):
            with rec.micro_batch(j):
                seed_forward(seed, step, j)
                out = model(*args, **kwargs)
                loss = out if loss_of is None else loss_of(out)
                (loss * acc.coefficient(loss)).backward()
    records += rec.records()
    records.append(Record("loss", "", "loss", (), "whole", torch.tensor(acc.loss(), dtype=torch.float64)))
    rescale(acc.grad_factor(), opt)
    opt.reduce_grads()
    norm = opt.grad_norm()
    st = shard_state_or_none(model)
    masters = opt.masters()
    for fqn in rec.backward_order(list(masters)):
        g = masters[fqn].grad
        if g is None:  # no loss reached it (NOTE [unused parameters] in meshlm/runtime/unused.py)
            continue
        module, _, name = fqn.rpartition(".")
        value, pl = full_value(g, st, None)
        records.append(Record("grad", module, name, None, pl, value))
    records.append(Record("norm", "", "grad norm", (), "whole", norm.detach().double().cpu().reshape(())))
    if grad_clip > 0:
        opt.clip_grad_norm_(grad_clip, norm)
    opt.step()
    records += param_records("param", model)
    opt.zero_grad()
    world = st.mesh.size() if st is not None else 1
    info = {
        "world": world,
        "grad_accum": len(micro_batches),
        "grad_clip": float(grad_clip),
        "compute_dtype": str(getattr(st, "compute_dtype", None) or _dtype_of(model)).removeprefix("torch."),
        **optimizer_meta(opt),
        **(meta or {}),
    }
    return Capture(records, info)


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
