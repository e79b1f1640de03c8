"""Two captures compared tensor by tensor, each against the tolerance derived for it.

NOTE [diff tolerances]
    Side b is the reference: every tolerance is computed from b's values (as the parity tests
    compute theirs from the one-device run), with the bounds of meshlm/train/tolerances.py:

    * ``init``: the weights the step starts from are equal (``INIT_ATOL``), up to one
      rounding of a side that stores them in a narrower dtype (``stored_bound``);
    * ``block``, ``constrain``: NOTE [activation tolerance];
    * ``loss``: ``LOSS_RTOL``;
    * ``grad``: ``grad_tol`` with the model's noise floor (``grad_noise_floor``);
    * ``norm``: the norm of the gradients' tolerances (``norm_and_bound``);
    * ``param``: the gradient's bound, through clipping (NOTE [clipped gradient bound]) and
      one step of the optimizer's update rule from a fresh state (NOTE [tolerances after
      steps], ``StepBounds`` at k = 1; for AdamW at most NOTE [first step of AdamW]'s), then
      stored in each side's dtype (``stored_bound``).

    A side that is another implementation (``meta["implementation"] == "transformers"``)
    puts NOTE [implementation tolerance] in place of the activation and gradient bounds and
    ``HF_LOSS_RTOL`` in place of ``LOSS_RTOL``.  A side that computes in bfloat16 adds its
    bf16 rounding (NOTE [mixed-precision parity]): 2R·ε for a side of R ranks, ε the largest
    |bf16 - float32| of that tensor at the same bf16-rounded weights, plus, where only one
    side is bf16, the largest |bf16 - float32| at the float32 weights (the other side did
    not round them); both measured on one device with plain torch (``calibration``, from
    meshlm/train/diff/calibrate.py).

    A tensor agrees when every element is within its tolerance; the report's ``ratio`` is
    the largest |a - b| / tol, so agreement is ratio <= 1 and a real bug shows as a ratio of
    thousands.  A tensor on one side only is a divergence for parameters and gradients (a
    parameter that got no gradient on one side, a name that does not map) and a note for
    forward tensors (another implementation, or a block that constrains differently, records
    other activations).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from meshlm.train import tolerances as tol
from meshlm.train.diff.record import PHASE, Capture, Record

Calibration = dict  # record key -> (ε at the bf16-rounded weights, |bf16 - float32| at the float32 weights)


@dataclass
class Row:
    """One tensor of the step, compared."""

    order: int  # position in execution order
    kind: str
    where: str  # the module path, or a parameter's FQN
    tensor: str
    axes: Optional[tuple]
    placements_a: str
    placements_b: str
    shape: tuple
    max_abs: float  # max |a - b|
    rel: float  # max |a - b| / max |b|
    tol: float  # the tolerance at the worst element (largest |a - b| / tol)
    ratio: float  # largest |a - b| / tol: > 1 is a divergence
    ok: bool
    note: str = ""  # why it could not be compared element by element, or what it is
    index: Optional[tuple] = None  # the worst element

    def label(self) -> str:
        return self.where if self.kind in ("init", "grad", "param") else f"{self.where} {self.tensor}"


@dataclass
class Report:
    """The comparison of two captures (``compare``): every tensor in execution order."""

    rows: list[Row]
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    meta_a: dict = field(default_factory=dict)
    meta_b: dict = field(default_factory=dict)

    @property
    def diverged(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def first(self) -> Optional[Row]:
        """The first tensor, in execution order, beyond its tolerance (None: the sides agree)."""
        return next((r for r in self.rows if not r.ok), None)

    @property
    def agree(self) -> bool:
        return self.first is None

    def top(self, n: int = 10) -> list[Row]:
        """The ``n`` tensors with the largest relative difference."""
        return sorted(self.rows, key=lambda r: (-_finite(r.rel), r.order))[:n]

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        first = self.first
        return {
            "agree": self.agree,
            "first": None if first is None else asdict(first),
            "diverged": len(self.diverged),
            "compared": len(self.rows),
            "top": [asdict(r) for r in self.top(top)],
            "only_a": self.only_a,
            "only_b": self.only_b,
            "a": self.meta_a,
            "b": self.meta_b,
            "rows": [asdict(r) for r in self.rows],
        }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e308


def _err(a: Tensor, b: Tensor) -> Tensor:
    """|a - b| element-wise in float64; equal values (infinities, NaN against NaN) are 0 and
    any other NaN infinite."""
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = (a - b).abs()
    return torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a float dtype narrower than float32, else 0 (float32 is what
    every bound is in already)."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point and dtype.itemsize < 4 else 0.0


class _Bounds:
    """The tolerances of every tensor b holds (NOTE [diff tolerances])."""

    def __init__(self, a: Capture, b: Capture, calibration: Optional[Calibration]):
        self.a, self.b = a, b
        self.impl = "transformers" in (a.meta.get("implementation"), b.meta.get("implementation"))
        self.bf16 = [m for m in (a.meta, b.meta) if m.get("compute_dtype") == "bfloat16"]
        if self.bf16 and calibration is None:
            raise ValueError(
                "compare: a side computes in bfloat16 and no calibration was given; measure the bf16 rounding "
                "with meshlm.train.diff.calibrate.calibrate (NOTE [diff tolerances])"
            )
        self.cal = calibration or {}
        ra, rb = a.by_key(), b.by_key()
        self.grads_b = {r.key: r.value for r in b.records if r.kind == "grad"}
        floor = tol.grad_noise_floor([g.double() for g in self.grads_b.values()])
        self.grad_tol = {k: self._grad(g.double(), k, floor) for k, g in self.grads_b.items()}
        both = [k for k in self.grads_b if k in ra]
        self.norm_bound = None
        self.clip = (1.0, 0.0)
        if both:
            norm, bound = tol.norm_and_bound({k: self.grads_b[k] for k in both}, {k: self.grad_tol[k] for k in both})
            self.norm_bound = float(bound)
            norm_b = rb.get(("norm", "", "grad norm"))
            n = float(norm_b.value) if norm_b is not None else float(norm)
            self.clip = tol.clip_coefficient_bound(float(b.meta.get("grad_clip", 0.0)), n, self.norm_bound)
        self.init_b = {(r.module, r.tensor): r.value for r in b.records if r.kind == "init"}

    def _bf16(self, key: tuple) -> float:
        """The bf16 terms of a tensor's tolerance (NOTE [diff tolerances])."""
        if not self.bf16:
            return 0.0
        eps, delta = self.cal.get(key, (None, None))
        if eps is None:
            raise ValueError(
                f"compare: no bf16 calibration for {key}; the calibration covers the tensors of both sides"
            )
        out = sum(tol.bf16_split_factor(int(m.get("world", 1))) * eps for m in self.bf16)
        return out + (delta if len(self.bf16) == 1 else 0.0)

    def _grad(self, g: Tensor, key: tuple, floor: float) -> Tensor:
        base = tol.implementation_tol(g) if self.impl else tol.grad_tol(g, floor)
        return base + self._bf16(key)

    def of(self, ra: Record, rb: Record) -> Tensor:
        b = rb.value.double()
        if rb.kind == "init":
            return (_unit(ra.value.dtype) + _unit(rb.value.dtype)) * b.abs() + tol.INIT_ATOL
        if rb.kind in ("block", "constrain"):
            base = tol.implementation_tol(b) if self.impl else tol.activation_tol(b)
            return base + self._bf16(rb.key)
        if rb.kind == "loss":
            rtol = tol.HF_LOSS_RTOL if self.impl else tol.LOSS_RTOL
            return rtol * b.abs() + self._bf16(rb.key)
        if rb.kind == "norm":
            if self.norm_bound is None:
                return tol.NORM_RTOL * b.abs()
            return torch.full_like(b, self.norm_bound)
        if rb.kind == "grad":
            return self.grad_tol[rb.key]
        if rb.kind == "param":
            return self._param(ra, rb)
        raise ValueError(f"compare: unknown record kind {rb.kind!r}")

    def _param(self, ra: Record, rb: Record) -> Tensor:
        meta = self.b.meta
        w_new = rb.value.double()
        w_old = self.init_b.get((rb.module, rb.tensor))
        gkey = ("grad", rb.module, rb.tensor)
        g = self.grads_b.get(gkey)
        kind, hp = meta.get("optimizer"), dict(meta.get("hp") or {})
        if "betas" in hp:
            hp["betas"] = tuple(hp["betas"])
        if w_old is None:
            raise ValueError(f"compare: side b has no initial value of {rb.where}")
        w_old = w_old.double()
        if g is None:  # no gradient: the optimizer left it as it was
            bound = torch.zeros_like(w_new)
        else:
            c, dc = self.clip
            g = g.double()
            one = tol.clipped_grad_tol(g, self.grad_tol[gkey], c, dc)
            gc = c * g
            sb = tol.StepBounds()
            sb.update(kind, hp, 1, gc, gc, tol.first_step_state(kind, hp, gc), w_old, w_new, one_step=one)
            # NOTE [first step of AdamW] in meshlm/train/tolerances.py
            cap = tol.first_update_cap(kind, hp) + tol.step_rounding(w_old, w_new, torch.full_like(w_old, hp["lr"]))
            bound = torch.minimum(sb.bound["param"], cap)
        return bound + (_unit(ra.value.dtype) + _unit(rb.value.dtype)) * (w_new.abs() + bound)


def compare(a: Capture, b: Capture, calibration: Optional[Calibration] = None) -> Report:
    """Compare capture ``a`` against the reference ``b`` (NOTE [diff tolerances])."""
    ra, rb = a.by_key(), b.by_key()
    bounds = _Bounds(a, b, calibration)
    rows: list[Row] = []
    for y in b.records:
        x = ra.get(y.key)
        if x is None:
            continue
        rows.append(_row(len(rows), x, y, bounds))
    only_a = [_name(r) for r in a.records if r.key not in rb]
    only_b = [_name(r) for r in b.records if r.key not in ra]
    for side, recs in (("a", a.records), ("b", b.records)):
        other = rb if side == "a" else ra
        for r in recs:
            if r.key not in other and r.kind in ("init", "grad", "param", "loss", "norm"):
                rows.append(
                    Row(
                        len(rows),
                        r.kind,
                        r.where,
                        r.tensor,
                        r.axes,
                        r.placements if side == "a" else "-",
                        r.placements if side == "b" else "-",
                        tuple(r.value.shape),
                        math.inf,
                        math.inf,
                        0.0,
                        math.inf,
                        False,
                        f"only on side {side}",
                    )
                )
    rows.sort(key=lambda r: (PHASE[r.kind], r.order))  # each phase in b's order, the phases in the step's
    for j, r in enumerate(rows):
        r.order = j
    return Report(rows, only_a, only_b, dict(a.meta), dict(b.meta))


def _name(r: Record) -> str:
    return f"{r.kind} {r.where}" + ("" if r.kind in ("init", "grad", "param") else f" {r.tensor}")


def _row(order: int, x: Record, y: Record, bounds: _Bounds) -> Row:
    common = dict(
        order=order,
        kind=y.kind,
        where=y.where,
        tensor=y.tensor,
        axes=y.axes if y.axes is not None else x.axes,
        placements_a=x.placements,
        placements_b=y.placements,
        shape=tuple(y.value.shape),
    )
    if tuple(x.value.shape) != tuple(y.value.shape):
        return Row(
            **common,
            max_abs=math.inf,
            rel=math.inf,
            tol=0.0,
            ratio=math.inf,
            ok=False,
            note=f"shape {tuple(x.value.shape)} on side a, {tuple(y.value.shape)} on side b",
        )
    err = _err(x.value, y.value)
    t = bounds.of(x, y).double().expand_as(err) if err.ndim else bounds.of(x, y).double().reshape(())
    i = tol.worst(err, t)
    ratio = tol.ratio(err, t)
    max_abs = float(err.max()) if err.numel() else 0.0
    scale = float(y.value.double().abs().max()) if y.value.numel() else 0.0
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    index = (
        None if i is None or err.ndim == 0 else tuple(int(v) for v in torch.unravel_index(torch.tensor(i), err.shape))
    )
    return Row(
        **common,
        max_abs=max_abs,
        rel=rel,
        tol=float(t.reshape(-1)[i]) if i is not None else 0.0,
        ratio=ratio,
        ok=ratio <= 1.0,
        index=index,
    )
