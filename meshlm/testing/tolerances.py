"""Every numerical tolerance of the parity tests, each with its justification.

Reference: the same model in fp32 on one process with a plain ``torch.optim`` optimizer.  A
sharded run differs from it only by the *order* of floating-point additions: a matmul
whose contraction dim is split adds partial sums across ranks, an all-reduce adds per-rank
terms in a different order, and DTensor's math decompositions (cross-entropy, RMSNorm)
reduce per shard first.  For a sum of K fp32 terms computed in two different orders the
difference is bounded by about 2·ceil(log2 K)·u·Σ|terms| (u = 2^-24 ≈ 6e-8) for the
blocked/pairwise summation the CPU kernels use; our largest reductions (batch·seq = 128
positions, vocab 256) give about 16·6e-8 ≈ 1e-6 relative to the magnitudes being summed.
We allow 10x that.

NOTE [tolerances after steps]
    The loss and gradient tolerances below hold for one forward and backward on *identical*
    weights.  After an optimizer step the two runs hold weights that differ by rounding, and
    their next gradients differ by that rounding pushed through the model (the "drift").
    ``meshlm.testing.parity`` never widens the one-step tolerances to absorb drift:

    * Gradients and losses are checked at every step against a plain torch copy of the model
      loaded with the sharded model's current weights (the *probe*; gathering moves bits
      without arithmetic), so the one-step tolerances hold exactly at every step.
    * Parameters and optimizer state are checked against the independent one-device run
      with a bound per element propagated through the optimizer's own update rule from
      (a) the one-step gradient tolerance and (b) the drift, measured with plain torch alone
      as the probe's gradient minus the reference's (both one-device fp32: no meshlm code).
      Write Δx for the bound on |x_sharded - x_reference| of element x, and g for the
      reference's gradient, g_p the probe's:

        Δg = grad_tol(g_p) + |g_p - g|                    one step + drift

      SGD (momentum μ, dampening 0, lr η):  b = μ·b + g,  w = w - η·b
        Δb_k = μ·Δb_{k-1} + Δg_k                          (b_0 = 0)
        Δw_k = Δw_{k-1} + η·Δb_k
      so with no drift the parameter error grows linearly, η·k·(grad error) for μ = 0 and
      η·Σ_j (1-μ^j)/(1-μ)·(grad error) with momentum.

      AdamW (β1, β2, eps, weight decay λ):  m = β1·m + (1-β1)·g,  v = β2·v + (1-β2)·g²,
      w = (1 - ηλ)·w - η·m̂/(s + eps)  with  m̂ = m/(1-β1^k),  s = sqrt(v/(1-β2^k))
        Δm_k = β1·Δm_{k-1} + (1-β1)·Δg
        Δv_k = β2·Δv_{k-1} + (1-β2)·Δg·(2|g| + Δg)        (|a² - b²| = |a-b|·|a+b|)
        Δs  ≤ min(sqrt(Δv̂), Δv̂/s)                       (|√a - √b| ≤ √|a-b|, ≤ |a-b|/√b)
        Δu  ≤ Δm̂/(s_lo + eps) + |m̂|·Δs/((s_lo + eps)(s + eps)),  s_lo = max(s - Δs, 0)
        Δw_k = (1 - ηλ)·Δw_{k-1} + η·Δu
      The update m̂/(s + eps) amplifies the error of an element whose s is tiny by up to
      1/eps (Δu → Δm̂/eps as s → 0): the bound says so element by element instead of
      hiding it.  Where s is well above Δs (every element with a real gradient) Δu is the
      relative error of m̂ and s, ~1e-5 times the update.  The scale of the gradient, which
      AdamW's update does not see (m̂/s is invariant under g -> 2g), is checked by the
      gradient itself and by m and v, whose bounds are linear in Δg.

    Each side rounds its own update: a handful of fp32 operations per element and state
    (AdamW: decay, lerp, two for v, sqrt, add, divide, addcdiv).  We add ``STEP_ULPS``·u
    times the magnitudes involved (old and new value, and the update η·|u|) per step.

    What a bug does against these bounds: a gradient averaged twice, or a micro-batch's
    gradient not divided by the number of micro-batches, is off by 50% or 100% of |g|.
    Measured on llama_tiny, 2 ranks, the ZeRO-1/2 gradient averaged twice at the step
    gives error/tolerance 2.5e4 on the gradient stepped with, 2.1e4 on SGD's momentum
    buffer, 1.9e4 on its parameters and 1.2e4 on AdamW's exp_avg/exp_avg_sq, but only 2.3
    on AdamW's parameters: AdamW's update is blind to a gradient's scale, which is why the
    gradient and the state are checked and not the parameters alone.  A local root's loss
    dropping the 1/grad_accum gives 5e4 on the gradient (tests/dist/test_parity.py,
    test_parity_catches_gradient_scale_bugs, keeps checking such bugs fail).

NOTE [invariance tolerance]
    The training loop's curves (tests/dist/test_train_invariance.py: 12 steps of
    llama_tiny, AdamW at lr 3e-3, against one process).  Each step's loss differs between
    layouts only by the order of fp32 additions (above: ~1e-6 relative per reduction,
    bounded by LOSS_RTOL = 1e-5 for one step).  Over training these differences feed back
    through the weights: AdamW's update m/sqrt(v) is O(lr) per element whatever the
    gradient's size, so a rounding-level gradient difference moves each weight by at most
    ~lr·(relative gradient error) per step, and the loss after k steps differs by about k
    times one step's error.  For 12 steps at lr 3e-3 that is ~12 x 1e-5 = 1.2e-4 relative;
    we allow 3e-4 (loss ~5, i.e. 1.5e-3 absolute).  A real bug (a wrong shard, a missing reduction, a
    batch fed to the wrong rank) changes the loss at step 1 by >1e-2.

    The gradient norm at step 1 (identical weights): each element of the gradient is
    within GRAD_RTOL·|g_i| + GRAD_ATOL_OF_MAX·max_p of the reference (max_p: the largest
    entry of its parameter p), so the norm is within GRAD_RTOL·|g| + GRAD_ATOL_OF_MAX·
    sqrt(Σ_p n_p·max_p²).  For llama_tiny at seed 0 on this config's first batch the second
    term is 22.7·|g| (|g| = 2.29; computed on one device), so the bound is 1e-5 x 23.7 =
    2.4e-4 relative: FIRST_NORM_RTOL = 3e-4.  Over 12 steps the same linear growth as for
    the loss gives 12 x 2.4e-4 = 2.9e-3; with the loss curve's slack (2.5x) NORM_RTOL =
    7e-3.  A gradient averaged twice or a missing 1/grad_accum doubles or halves the norm:
    a relative error of 0.5 to 1, over 1000 times FIRST_NORM_RTOL.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

U = 2.0**-24  # fp32 unit roundoff

# Loss: a mean over 128 positions of per-position losses of magnitude ~5.5.
LOSS_RTOL = 1e-5

# Gradients: compared element-wise with an absolute term scaled by the largest reference
# gradient entry of that parameter (gradients of near-zero entries carry the rounding of
# the sums that produce the large ones), and a relative term for the rest.
GRAD_RTOL = 1e-5
GRAD_ATOL_OF_MAX = 1e-5

# Rounding of one optimizer update on either side, in units of u times the magnitudes
# involved (NOTE [tolerances after steps]): about ten fp32 operations per element on each of
# the two sides.
STEP_ULPS = 32

# Initialisation from a seed replays the one-device init order: exact.
INIT_ATOL = 0.0

# The training loop's loss and gradient-norm curves over 12 steps (NOTE [invariance tolerance]).
INVARIANCE_RTOL = 3e-4
FIRST_NORM_RTOL = 3e-4
NORM_RTOL = 7e-3


def grad_tol(g: Tensor) -> Tensor:
    """Element-wise one-step tolerance of a gradient whose reference (at the same weights)
    is ``g``."""
    return GRAD_RTOL * g.abs() + GRAD_ATOL_OF_MAX * float(g.abs().max())


def _round(*xs: Tensor) -> Tensor:
    return STEP_ULPS * U * sum(x.abs() for x in xs)


class StepBounds:
    """Bounds on |sharded - reference| of one parameter and its optimizer state, carried
    from step to step (NOTE [tolerances after steps]).  ``update(kind, hp, k, g, g_probe,
    ref_state, w_old, w_new)`` advances them by step ``k`` given the reference's gradient
    ``g``, the probe's ``g_probe`` and the reference's state after the step; the bounds are
    then in ``self.bound`` keyed like the optimizer state, plus ``"param"``."""

    def __init__(self):
        self.bound: dict[str, Tensor] = {}

    def update(self, kind: str, hp: dict, k: int, g: Tensor, g_probe: Tensor, state: dict,
               w_old: Tensor, w_new: Tensor) -> None:
        dg = grad_tol(g_probe) + (g_probe - g).abs()
        b = self.bound
        zero = torch.zeros_like(g)
        lr = hp["lr"]
        if kind == "sgd":
            mu = hp.get("momentum", 0.0)
            if mu:
                buf = state["momentum_buffer"]
                b["momentum_buffer"] = mu * b.get("momentum_buffer", zero) + dg + _round(buf, g)
                step_err = b["momentum_buffer"]
            else:
                step_err = dg
            b["param"] = b.get("param", zero) + lr * step_err + _round(w_old, w_new)
        elif kind == "adamw":
            b1, b2 = hp.get("betas", (0.9, 0.999))
            eps, wd = hp.get("eps", 1e-8), hp.get("weight_decay", 1e-2)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            b["exp_avg"] = b1 * b.get("exp_avg", zero) + (1 - b1) * dg + _round(m, g)
            b["exp_avg_sq"] = b2 * b.get("exp_avg_sq", zero) + (1 - b2) * dg * (2 * g.abs() + dg) + _round(v, g * g)
            c1, c2 = 1 - b1**k, 1 - b2**k
            s = (v / c2).sqrt()
            dv = b["exp_avg_sq"] / c2
            ds = torch.minimum(dv.sqrt(), torch.where(s > 0, dv / s.clamp_min(1e-38), dv.sqrt()))
            s_lo = (s - ds).clamp_min(0)
            mh, dm = m / c1, b["exp_avg"] / c1
            du = dm / (s_lo + eps) + mh.abs() * ds / ((s_lo + eps) * (s + eps))
            u = mh.abs() / (s + eps)
            b["param"] = (1 - lr * wd) * b.get("param", zero) + lr * du + _round(w_old, w_new, lr * u)
        else:
            raise ValueError(f"StepBounds: no bounds derived for optimizer {kind!r}")


def ratio(err: Tensor, tol: Tensor) -> float:
    """max(|err| / tol) over the elements (0 where both are 0; inf where only tol is)."""
    err = err.abs()
    r = torch.where(tol > 0, err / tol.clamp_min(1e-45), torch.where(err > 0, math.inf, 0.0))
    return float(r.max()) if r.numel() else 0.0
