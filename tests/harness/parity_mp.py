"""Mixed-precision parity: ``check_training(..., precision="bf16")``.

The sharded model is sharded with the dtypes ``meshlm train`` uses under
``train.param_dtype=bfloat16`` (``meshlm.app.train.shard_dtypes``): bf16 compute over float32
storage, or, for ZeRO-1/2 on more than one rank, bf16 storage with float32 masters and
float32 main gradients; gradients reduced and accumulated in float32 (NOTE [mixed
precision] in meshlm/layout/precision.py).

The reference is the same recipe written in plain torch, borrowing nothing from meshlm:
float32 master weights stepped by a plain ``torch.optim`` optimizer; for each step a bf16
copy of the model (``copy.deepcopy(model).to(torch.bfloat16)``, its weights the masters
rounded to nearest), through which every micro-batch runs forward and backward; each
micro-batch's bf16 gradients are cast to float32 and added into the masters' ``.grad``.
Every weight is thus used in bf16 and every activation and activation gradient is the
same bf16 computation as the sharded model's (meshlm casts each parameter at use, before
any gather, and runs the model's own code on it): the two runs differ only where a sum is
split across ranks (its partials rounded to bf16 before they are added) and in the order
of float32 additions.  A ``torch.autocast`` reference would not: it keeps the residual
stream in float32, a difference as large as bf16's whole rounding error.

The probe (NOTE [tolerances after steps] in meshlm/train/tolerances.py) is that
recipe on a plain copy loaded with the sharded float32 masters, so the one-step
tolerances hold at every step; they are in units of the bf16 rounding error of the
probe's own gradient, measured with plain torch alone at the same weights (NOTE
[mixed-precision parity] in tolerances.py).  Parameters, masters and optimizer state are
checked against the independent run with the same propagated bounds as in float32; a
parameter stored in bf16 may differ by one more rounding of its master
(``tolerances.stored_bound``).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor, nn

from harness import tolerances as tol
from harness.recipes import FP32, forwards, full_many
from harness.recipes import accumulate as _accumulate
from harness.recipes import forward_seed as _forward_seed


class BF16(FP32):
    """The bf16 mixed-precision recipe of ``check_training`` (module docstring)."""

    grad_dtype = torch.float32

    def __init__(self, mesh):
        self.ranks = mesh.size()
        self.compiled = False
        self._low: dict = {}  # plain float32 model -> its bf16 compute copy
        self._plain: dict = {}  # the float32 model the bf16 rounding error is measured against

    def shard_dtypes(self, layout: str, mesh, compile: str | None, comms: str) -> dict:
        import meshlm
        from meshlm.app.config import TrainConfig
        from meshlm.layout.precision import shard_dtypes

        self.compiled = compile is not None
        t = TrainConfig(param_dtype="bfloat16", compile=compile or "none", compile_comms=comms)
        return shard_dtypes(t, meshlm.load_layout(layout), dict(zip(mesh.mesh_dim_names, mesh.shape)))

    def _copy(self, model: nn.Module) -> nn.Module:
        """``model``'s bf16 compute copy (made once), holding its weights rounded to nearest."""
        low = self._low.get(model)
        if low is None:
            low = self._low[model] = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():
            for p, q in zip(model.parameters(), low.parameters()):
                q.copy_(p)
                p.grad = q.grad = None
        return low

    def accumulate(self, model: nn.Module, micro: list, grad_accum: int, seed: int, step: int) -> list[Tensor]:
        low = self._copy(model)
        pairs = list(zip(model.parameters(), low.parameters()))
        losses = []
        for loss, share in forwards(low, micro, seed, step):  # the whole step's weighting (recipes.accumulate)
            (loss * share).backward()
            losses.append(loss.detach())
            with torch.no_grad():  # accumulate in float32
                for p, q in pairs:
                    if q.grad is not None:
                        p.grad = q.grad.float() if p.grad is None else p.grad.add_(q.grad.float())
                        q.grad = None
        return losses

    @contextlib.contextmanager
    def watching(self, mesh, what: str):
        """Every gradient reduction over a data axis (in backward, or at the step) moves
        float32 (NOTE [mixed precision]): one more bf16 rounding per reduction is within the
        numerical tolerances (NOTE [mixed-precision parity]), so it is checked here.  Eager
        runs only (a dispatch mode around compiled blocks would change what they trace)."""
        if self.compiled:
            yield contextlib.nullcontext
            return
        from meshlm.core.axes import DATA_AXES
        from meshlm.runtime.comm import CommCounter

        cc = CommCounter(mesh)
        with cc:
            yield lambda: cc.phase("step")
        bad = [
            c
            for c in cc.records
            if c.kind in ("all_reduce", "reduce_scatter")
            and c.phase != "forward"
            and any(a in DATA_AXES for a in c.axes)
            and c.dtype != torch.float32
            and c.dtype.is_floating_point  # a gradient (NOTE [unused parameters]' flags are bytes)
        ]
        assert not bad, (
            f"{what}: {len(bad)} gradient reductions over data axes not in float32, e.g. "
            f"{bad[0].kind} over {bad[0].axes} in {bad[0].dtype} ({bad[0].phase})"
        )

    def probe_weights(self, model: nn.Module, opt) -> dict[str, Tensor]:
        return {n: m.float() for n, m in full_many(opt.masters()).items()}

    def tolerances(
        self, job, weights: dict, micro: list, losses: list, grads: dict, seed: int, step: int
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        # The probe's own bf16 rounding error, measured against float32 at the same
        # bf16-rounded weights (weight rounding excluded: both runs round the weights alike):
        # the gradients of the whole step, and the loss of every row of every micro-batch.
        m32 = job.plain({n: w.to(torch.bfloat16).float() for n, w in weights.items()}, seed, self._plain, "fp32")
        _accumulate(m32, micro, job.grad_accum, seed, step)
        grads32 = {n: p.grad for n, p in m32.named_parameters()}
        m16 = self._copy(m32)
        row_errs = []
        with torch.no_grad():
            for j, (args, kwargs) in enumerate(micro):
                for a, kw in _rows(args, kwargs, job.input_axes):
                    torch.manual_seed(_forward_seed(seed, step, j))
                    lo = m16(*a, **kw).float()
                    torch.manual_seed(_forward_seed(seed, step, j))
                    hi = m32(*a, **kw).float()
                    if bool(torch.isfinite(lo) & torch.isfinite(hi)):  # not a row without targets
                        row_errs.append(float((lo - hi).abs()))
        return (
            tol.bf16_loss_tols(losses, row_errs, self.ranks),
            {n: tol.bf16_grad_tol(g, grads32[n], self.ranks) for n, g in grads.items()},
        )


def _rows(args: tuple, kwargs: dict, input_axes: dict):
    """The micro-batch ``(args, kwargs)`` one row at a time: every tensor sliced along its
    "batch" dimension (``input_axes``; dim 0 where none is named)."""

    def dim(key):
        axes = tuple(input_axes.get(key) or ())
        return axes.index("batch") if "batch" in axes else 0

    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
    tensors += [(k, v) for k, v in kwargs.items() if isinstance(v, Tensor)]
    key, first = tensors[0]
    for r in range(first.shape[dim(key)]):

        def one(k, x, r=r):
            return x.narrow(dim(k), r, 1) if isinstance(x, Tensor) else x

        yield [one(i, a) for i, a in enumerate(args)], {k: one(k, v) for k, v in kwargs.items()}
