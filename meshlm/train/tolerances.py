"""The numerical tolerances of comparing two training runs of one model, each derived.

Two runs of the same model on the same weights and batch under two layouts (or on one
device with a plain ``torch.optim`` optimizer) differ only by the *order* of floating-point
additions: a matmul whose contraction dim is split adds partial sums across ranks, an
all-reduce adds per-rank terms in a different order, and DTensor's math decompositions
(cross-entropy, RMSNorm) reduce per shard first.  For a sum of K fp32 terms computed in two
different orders the difference is bounded by about 2·ceil(log2 K)·u·Σ|terms| (u = 2^-24 ≈
6e-8) for the blocked/pairwise summation the CPU kernels use; our largest reductions
(batch·seq = 128 positions, vocab 256) give about 16·6e-8 ≈ 1e-6 relative to the magnitudes
being summed.  We allow 10x that.

Who uses them: ``meshlm diff`` (meshlm/train/diff/, which says of every tensor of a step
whether two configurations agree within these bounds) and the parity tests (tests/harness/,
which hold every layout against one device and import them from here; the tolerances only
the tests need stay in tests/harness/tolerances.py).  One place, so that the tool and the
tests cannot drift apart.

NOTE [tolerances after steps]
    The loss and gradient tolerances below hold for one forward and backward on *identical*
    weights.  After an optimizer step the two runs hold weights that differ by rounding, and
    their next gradients differ by that rounding pushed through the model (the "drift").
    ``harness.parity`` never widens the one-step tolerances to absorb drift:

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

NOTE [mixed-precision parity]
    ``check_training(precision="bf16")`` (tests/harness/parity_mp.py) runs the sharded
    model with the dtypes ``meshlm train`` uses under ``param_dtype=bfloat16`` against the
    same recipe in plain torch: a bf16 copy of the model holding the float32 masters rounded
    to nearest, forward and backward through it, its bf16 gradients cast to float32 and
    accumulated over the micro-batches, a float32 ``torch.optim`` step on the masters.

    What differs.  On the CPU (torch 2.13, checked with oneDNN's kernel and with the native
    one) a bf16 matmul accumulates in float32 and rounds each output once to bf16 (4096
    products 1·(1 + 2^-7) sum to 4128 exactly; a bf16 accumulator would stall at 256), and
    an output row does not depend on the other rows (a kernel whose float32 order did would
    still round each output once: a different rounding at the same site, which the bound
    below counts).  The tensor-parallel activations are all-reduced in bf16 (counted with
    ``CommCounter``).  Both runs use the same bf16 weights (meshlm casts before it gathers,
    and gathers move bits) and run the same operations in the same dtypes on every row, so
    they differ only (a) at *split sums*: a sum whose terms lie on R ranks (a weight
    gradient over a batch split over data axes; a row-parallel matmul output, or the input
    gradient of a column-parallel one, over tp) is R partial sums, each rounded to bf16,
    then added (in float32 for gradient reductions; in bf16, R - 1 more roundings, for
    activations), where the reference rounds the whole sum once; and (b) in the order of
    float32 additions (``grad_tol``, ``LOSS_RTOL``, as in float32).

    The bound.  A rounding is x -> x(1 + δ), |δ| <= u16 = 2^-8.  To first order a computed
    gradient is the exact one plus Σ_i c_i·δ_i over its rounding sites i.  The reference's
    own error e = g16 - g32, against float32 at the same bf16-rounded weights (so the weight
    rounding, the same in both runs, is left out; plain torch, nothing from meshlm), is one
    such sum over all its sites.  The sharded run's is a sum over the same sites with at
    most 2R - 1 roundings where the reference has one, so if ε is the effect of one pattern
    of bf16 roundings, |g_sh - g32| <= (2R - 1)·ε and

        |g_sh - g16| <= |g_sh - g32| + |g16 - g32| <= 2R·ε.

    ε is not known element by element (one element's e can vanish by chance), so it is taken
    per parameter as max|e| over its elements, thousands of samples of the same rounding
    process (as ``grad_tol`` scales its absolute term by the parameter's largest gradient),
    and R as the world size (no sum is split over more ranks):

        tol(g) = grad_tol(g16) + 2R·max_p |g16 - g32|                (``bf16_grad_tol``)

    A micro-batch's loss is a mean over its rows (weights >= 0 summing to 1), so its error
    is at most its worst row's; each row alone, in bf16 and in float32 (plain torch), gives
    that row's e:

        tol(L) = LOSS_RTOL·|L| + 2R·max_rows |L16_row - L32_row|     (``bf16_loss_tols``)

    This is a first-order bound whose scale is measured, at every step on the probe's
    weights, rather than a number fixed once.  After steps the propagation of NOTE
    [tolerances after steps] applies unchanged with Δg = tol(g) + |g_probe - g|; the drift
    is larger than in float32, since masters that differ by float32 rounding can round to
    neighbouring bf16 weights, and the probe measures it.  A parameter stored in bf16
    (ZeRO-1/2) is its master rounded to nearest: ``stored_bound``.

    What the bound cannot see: one more bf16 rounding per split sum, such as a gradient
    reduced in bf16, is within 2R·ε by construction (measured on 2 ranks: the gradient's
    ratio goes from 0.19 to 0.32 on zero2 and ddp).  So the bf16 harness also fails any
    gradient reduction over a data axis that is not float32 (``meshlm.runtime.comm.CommCounter``,
    eager runs) and any gradient (``.grad`` or main gradient) not float32 after backward.

    Measured (llama_tiny, 3 steps of 2 micro-batches, SGD and AdamW; worst error/tolerance):
    gradient 0.19 for ddp, zero1, zero2, fsdp, hsdp on 2 ranks, overlapped or not, 0.51 for
    tp and tp_sp on tp=2, 0.14 for zero1 and hsdp on dp=2,fsdp=2, 0.26 for fsdp_tp on
    fsdp=2,tp=2, 0.24 for tp=4 (0.21-0.23 and 0.39-0.51 with other seeds, ignored targets,
    dropout or 5 steps); loss 4e-4 to 6e-4 data parallel (float32 order only), 0.02-0.09
    with tp; parameters 0.1-0.37 where stored in float32, 0.95-0.96 where stored in bf16 (an
    element whose master lies near a rounding midpoint, where ``stored_bound`` is tight by
    construction); optimizer state <= 0.87 (exp_avg_sq, as in float32).  Bugs
    (tests/dist/test_parity.py, test_parity_bf16_catches_bugs): a main gradient added twice,
    main gradients replaced instead of accumulated over micro-batches, and a missing
    1/grad_accum (zero1, ddp) each fail the first gradient they reach (tok_emb's, step 1) by
    35x; over a whole run (strict=False) the worst gradient is 80x, 48x and 80x (SGD), 65x,
    43x and 65x (AdamW).  A doubled gradient leaves AdamW's parameters within bounds (0.63x:
    its update is blind to a gradient's scale, NOTE [tolerances after steps]) but not its
    state (75x); lost accumulation fails its parameters too (21x).

NOTE [activation tolerance]
    A forward activation (a block's output, a ``constrain``ed tensor) of two runs at the same
    weights and inputs is computed by the same ops in another order: a contraction split over
    tp is R partial sums added, the norms reduce per shard, an attention kernel blocks its
    sums by what it is given.  Each such sum is off by at most ~1e-6 of the magnitudes it adds
    (above), which are at most the largest entries of the tensors around it; an error then
    travels on through the residual stream (an identity) and the normalised branches, adding
    up over the blocks before it.  So, as for a gradient, an element-wise bound with a
    relative term and an absolute term scaled by the tensor's largest entry:

        tol(x) = ACT_RTOL·|x| + ACT_ATOL_OF_MAX·max|x|              (``activation_tol``)

    both 1e-5: 10x the per-sum bound, which covers a handful of blocks (the shipped test
    models have 2 to 4).  Compiled blocks (aot_eager, inductor) fuse and reorder the same
    float32 arithmetic: the same bound.  Measured with ``meshlm diff``, every shipped layout
    on 2 and 4 ranks against ``single`` on one device, eager and aot_eager (llama_tiny, and
    vlm_tiny for vlm_fsdp_tp; benchmarks/results/diff/layouts.md): worst |diff| / tol 0.035
    (llama_tiny, tensor parallel), 0.051 (the VLM), 0 for the pure data-parallel layouts,
    whose blocks compute what one device computes.  The bugs of tests/dist/test_diff.py move
    the first activation they reach 2e2 to 2e3 times past it (a query shard's RoPE offset,
    a block whose output depends on the rank).

NOTE [clipped gradient bound]
    The optimizer steps with the gradient clipped to a global norm C: g·c, c = min(1, C/(n +
    1e-6)) (``ShardedOptimizer.clip_grad_norm_``).  Two runs' norms n_a, n_b differ by at most
    Δn (``norm_and_bound`` of their gradient tolerances), and c is Lipschitz in n with
    constant C/n² on [n_lo, ∞), so with n_lo = max(n_b - Δn, 0):

        Δc <= C·Δn/(n_lo + 1e-6)²           (0 when neither run clips)
        |c_a·g_a - c_b·g_b| <= c_a·|g_a - g_b| + |c_a - c_b|·|g_b|
                            <= (c_b + Δc)·tol(g) + Δc·|g_b|        (``clipped_grad_tol``)

    which then enters NOTE [tolerances after steps] as the one-step gradient error.

NOTE [first step of AdamW]
    From a fresh state AdamW's first update of an element is m̂/(sqrt(v̂) + eps) with m̂ = g and
    v̂ = g² (bias-corrected), i.e. g/(|g| + eps): at most 1 in size on either side, whatever
    the gradient.  Two runs starting from equal weights therefore end their first step at most
    2·lr apart, besides the rounding of the update (``STEP_ULPS``).  The propagated bound of
    NOTE [tolerances after steps] says more where the gradient is well above its error and
    much less where it is not (its 1/eps amplification for an element whose gradient is near
    zero, where a rounding-level difference can flip the update's sign): ``meshlm diff`` takes
    the smaller of the two (``first_update_cap``).  Like every AdamW parameter bound it is
    blind to the gradient's scale (g -> 2g changes nothing), which the gradients themselves
    are checked for.

NOTE [implementation tolerance]
    A Hugging Face ``transformers`` model against meshlm's model of the same architecture and
    weights: two implementations, not one in two summation orders.  transformers fuses or
    splits other matmuls and reaches SDPA through its own masks, so each of the ~30 ops of a
    2-layer model rounds differently, a few u relative to its inputs each, and each norm
    divides the accumulated absolute error by its input's standard deviation: about 1e-6 to
    1e-5 relative, as for the logits (``HF_LOGIT_RTOL``).  Backward runs as many ops again.
    Hidden states and gradients are held to the same form as the other bounds with 1e-4
    (10x that): HF_RTOL·|x| + HF_ATOL_OF_MAX·max|x| (``implementation_tol``); the loss to
    ``HF_LOSS_RTOL``.  Measured on the tiny GQA Llama of tests/harness/hf_tiny.py
    (tests/dist/test_diff.py, and meshlm under tp, tp_sp and fsdp_tp on 2 and 4 ranks): 0
    against meshlm on one device (its Llama computes what transformers' does there, op for
    op), at most 0.005 (a gradient) under tensor parallelism; a decoder layer's output off
    by 0.1% is named at that block.
"""

from __future__ import annotations

import math
from typing import Optional

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

# Forward activations (NOTE [activation tolerance]): the gradients' form and size.
ACT_RTOL = 1e-5
ACT_ATOL_OF_MAX = 1e-5

# Rounding of one optimizer update on either side, in units of u times the magnitudes
# involved (NOTE [tolerances after steps]): about ten fp32 operations per element on each of
# the two sides.
STEP_ULPS = 32

# Initialisation from a seed replays the one-device init order: exact.
INIT_ATOL = 0.0

# Global gradient norm (ShardedOptimizer.grad_norm) against the one-device norm: the norm is
# sqrt(sum g^2), and |d||g||| <= ||dg|| (triangle inequality), so its relative error is at
# most the gradients' own relative error in the 2-norm, which the argument above puts at
# about 1e-6 (fp32 summation order); the norm's float64 accumulation adds nothing at this
# scale.  Same 10x margin as the gradients.
NORM_RTOL = 1e-5

# Logits of a model loaded from a Hugging Face directory against transformers' own forward
# of the same weights, both fp32 (tests/dist/test_hf.py, test_hf_gpt2.py).  Here the two
# sides are different implementations, not one model in two summation orders: transformers
# fuses or splits other matmuls, writes GELU's tanh formula out where meshlm calls the fused
# kernel, and reaches SDPA through its own masks; so each of the ~30 ops of a 2-layer model
# rounds differently, a few u (6e-8) relative to its inputs each, and each LayerNorm divides
# the accumulated absolute error by its input's standard deviation.  That stacks to about
# 1e-6 to 1e-5 relative; we allow 1e-4, and 1e-5 absolute for logits near zero (the tiny
# models' logits are up to 0.7 (Llama) and 3.4 (GPT-2) in size).  Measured, worst |diff| /
# (atol + rtol·|ref|): Llama 0.016 (4 ranks, every layout; 0 where no tensor-parallel split),
# GPT-2 0.05 to 0.10 (2 ranks, every layout, tied and untied; 0.087 on fsdp=2,tp=2), LLaVA
# 0.11 to 0.16 (logits up to 3.3; one device and 4 ranks, tests/unit/test_hf_llava.py and
# tests/dist/test_hf_llava_layouts.py).  What this catches (break-it checks): a wrong weight,
# permutation or transpose; in GPT-2, exact GELU instead of its tanh approximation (44x) or
# LayerNorm eps 1e-6 for 1e-5 (45x); in LLaVA, exact GELU for the tower's quick GELU (1060x),
# the tanh approximation in the projector (67x), the tower's eps 1e-5 for its 1e-3 (305x).
HF_LOGIT_RTOL = 1e-4
HF_LOGIT_ATOL = 1e-5

# meshlm's Llama against transformers' on the same fp32 weights: the same math in a different
# order (SDPA against HF's attention, RoPE applied per head pair against rotate_half), so the
# logits differ by fp32 rounding amplified through the layers; tests/dist/test_hf.py holds
# them to rtol 1e-4.  The mean cross-entropy is a smooth average of those logits (its gradient
# in each logit is below 1/n per token), so its relative error is below theirs: 1e-4.
HF_LOSS_RTOL = 1e-4

# Hidden states and gradients of transformers' model against meshlm's (NOTE [implementation
# tolerance]).
HF_RTOL = 1e-4
HF_ATOL_OF_MAX = 1e-4

# Mixed precision: bf16 compute, fp32 reduction and accumulation (NOTE [mixed precision] in
# meshlm/layout/precision.py).  Unit roundoffs (round to nearest): bf16 keeps 8 significant bits,
# u = 2^-8; fp32 keeps 24, u = 2^-24.
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24


def grad_tol(g: Tensor, floor: float = 0.0) -> Tensor:
    """Element-wise one-step tolerance of a gradient whose reference (at the same weights)
    is ``g``; ``floor``: the model's noise floor (:func:`grad_noise_floor`)."""
    return GRAD_RTOL * g.abs() + max(GRAD_ATOL_OF_MAX * float(g.abs().max()), floor)


def activation_tol(x: Tensor) -> Tensor:
    """Element-wise tolerance of a forward activation whose reference is ``x`` (NOTE
    [activation tolerance])."""
    a = x.abs()
    return ACT_RTOL * a + ACT_ATOL_OF_MAX * (float(a.max()) if a.numel() else 0.0)


def implementation_tol(x: Tensor) -> Tensor:
    """Element-wise tolerance of a hidden state or gradient of another implementation of the
    same model whose reference is ``x`` (NOTE [implementation tolerance])."""
    a = x.abs()
    return HF_RTOL * a + HF_ATOL_OF_MAX * (float(a.max()) if a.numel() else 0.0)


def grad_noise_floor(grads) -> float:
    """The smallest absolute gradient tolerance of any parameter: one unit roundoff of the
    largest gradient entry in the model.

    A parameter whose gradient is zero in exact arithmetic gets, in fp32, the rounding of
    sums whose terms are as large as the gradients around it, differently ordered on each
    side.  A key bias is one (shifting every key of a head by one vector shifts all the
    scores of a query alike, which softmax ignores: CLIP's k_proj bias in meshlm's VLM sees
    gradients of ~1e-14 either side of zero).  A bound scaled by that parameter's own
    largest entry would compare noise with noise; U x the model's largest entry is far
    below any real gradient (a doubled gradient of an entry above it still fails)."""
    return U * max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)


def bf16_split_factor(ranks: int) -> int:
    """2R of NOTE [mixed-precision parity]: a sum split over R <= ``ranks`` ranks rounds at
    most 2R - 1 times where one device rounds once; plus the reference's own rounding."""
    return 2 * ranks


def bf16_grad_tol(g: Tensor, g32: Tensor, ranks: int) -> Tensor:
    """One-step tolerance of a gradient whose bf16-recipe value at the probe's weights is
    ``g`` and float32 value at the same bf16-rounded weights ``g32`` (NOTE [mixed-precision
    parity])."""
    return grad_tol(g) + bf16_split_factor(ranks) * float((g - g32).abs().max())


def bf16_loss_tols(losses: list, row_errors: list, ranks: int) -> list:
    """One-step tolerances of a step's micro-batch losses whose bf16-recipe values are
    ``losses``, given ``row_errors``: |bf16 - float32| of the loss of each row of the step's
    micro-batches on its own (NOTE [mixed-precision parity])."""
    e = max(row_errors, default=0.0)
    return [LOSS_RTOL * a.float().abs() + bf16_split_factor(ranks) * e for a in losses]


def step_rounding(*xs: Tensor) -> Tensor:
    """``STEP_ULPS``·u times the magnitudes ``xs`` of one update's operands and result: the
    rounding of the update on both sides (NOTE [tolerances after steps])."""
    return STEP_ULPS * U * sum(x.abs() for x in xs)


class StepBounds:
    """Bounds on |sharded - reference| of one parameter and its optimizer state, carried
    from step to step (NOTE [tolerances after steps]).  ``update(kind, hp, k, g, g_probe,
    ref_state, w_old, w_new)`` advances them by step ``k`` given the reference's gradient
    ``g``, the probe's ``g_probe`` and the reference's state after the step (``one_step``:
    the one-step gradient tolerance at the probe, default ``grad_tol(g_probe)``); the bounds
    are then in ``self.bound`` keyed like the optimizer state, plus ``"param"``."""

    def __init__(self):
        self.bound: dict[str, Tensor] = {}

    def update(
        self,
        kind: str,
        hp: dict,
        k: int,
        g: Tensor,
        g_probe: Tensor,
        state: dict,
        w_old: Tensor,
        w_new: Tensor,
        one_step: Tensor | None = None,
    ) -> None:
        dg = (grad_tol(g_probe) if one_step is None else one_step) + (g_probe - g).abs()
        b = self.bound
        zero = torch.zeros_like(g)
        lr = hp["lr"]
        if kind == "sgd":
            mu = hp.get("momentum", 0.0)
            if mu:
                buf = state["momentum_buffer"]
                b["momentum_buffer"] = mu * b.get("momentum_buffer", zero) + dg + step_rounding(buf, g)
                step_err = b["momentum_buffer"]
            else:
                step_err = dg
            b["param"] = b.get("param", zero) + lr * step_err + step_rounding(w_old, w_new)
        elif kind == "adamw":
            b1, b2 = hp.get("betas", (0.9, 0.999))
            eps, wd = hp.get("eps", 1e-8), hp.get("weight_decay", 1e-2)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            b["exp_avg"] = b1 * b.get("exp_avg", zero) + (1 - b1) * dg + step_rounding(m, g)
            b["exp_avg_sq"] = (
                b2 * b.get("exp_avg_sq", zero) + (1 - b2) * dg * (2 * g.abs() + dg) + step_rounding(v, g * g)
            )
            c1, c2 = 1 - b1**k, 1 - b2**k
            s = (v / c2).sqrt()
            dv = b["exp_avg_sq"] / c2
            ds = torch.minimum(dv.sqrt(), torch.where(s > 0, dv / s.clamp_min(1e-38), dv.sqrt()))
            s_lo = (s - ds).clamp_min(0)
            mh, dm = m / c1, b["exp_avg"] / c1
            du = dm / (s_lo + eps) + mh.abs() * ds / ((s_lo + eps) * (s + eps))
            u = mh.abs() / (s + eps)
            b["param"] = (1 - lr * wd) * b.get("param", zero) + lr * du + step_rounding(w_old, w_new, lr * u)
        else:
            raise ValueError(f"StepBounds: no bounds derived for optimizer {kind!r}")


def first_step_state(kind: str, hp: dict, g: Tensor) -> dict[str, Tensor]:
    """The optimizer state after the first step from a fresh state, given its gradient ``g``
    (what ``StepBounds.update`` takes as the reference's state at ``k = 1``): AdamW's moments
    (1-β1)·g and (1-β2)·g², SGD's momentum buffer g."""
    if kind == "adamw":
        b1, b2 = hp.get("betas", (0.9, 0.999))
        return {"exp_avg": (1 - b1) * g, "exp_avg_sq": (1 - b2) * g * g}
    if kind == "sgd":
        return {"momentum_buffer": g.clone()}
    raise ValueError(f"first_step_state: no bounds derived for optimizer {kind!r}")


def first_update_cap(kind: str, hp: dict) -> float:
    """A bound on |w_a - w_b| after one step from equal weights and a fresh state that holds
    whatever the gradients (NOTE [first step of AdamW]); inf where none is derived."""
    if kind != "adamw":
        return math.inf
    return 2 * hp["lr"]


def norm_and_bound(grads: dict[str, Tensor], tols: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The global L2 norm of the reference ``grads`` (float64) and the bound on the sharded
    norm's distance from it: | ||a|| - ||b|| | <= ||a - b|| <= ||tols|| whenever every
    gradient is within its element-wise tolerance, plus the sharded norm's own rounding
    (float64 sums of squares, rounded once to float32: U relative)."""
    have = [n for n, g in grads.items() if g is not None]  # a parameter no loss reaches has none
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grads[n].double()) for n in have]))
    slack = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(tols[n].double()) for n in have]))
    return norm, slack + 2 * U * norm


def clip_coefficient_bound(max_norm: float, norm: float, norm_bound: float) -> tuple[float, float]:
    """(c, Δc) of NOTE [clipped gradient bound]: the clip coefficient of a run whose gradient
    norm is ``norm`` and the bound on another run's, whose norm is within ``norm_bound``."""
    if max_norm <= 0:
        return 1.0, 0.0
    c = min(1.0, max_norm / (norm + 1e-6))
    if norm + norm_bound + 1e-6 <= max_norm:  # neither run clips
        return c, 0.0
    lo = max(norm - norm_bound, 0.0)
    return c, max_norm * norm_bound / (lo + 1e-6) ** 2


def clipped_grad_tol(g: Tensor, tol: Tensor, c: float, dc: float) -> Tensor:
    """Bound on |c_a·g_a - c_b·g_b| given the reference's gradient ``g`` = g_b, the bound
    ``tol`` on |g_a - g_b|, its clip coefficient ``c`` and ``dc`` >= |c_a - c_b| (NOTE
    [clipped gradient bound])."""
    return (c + dc) * tol + dc * g.abs()


def stored_bound(bound: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """Bound on |stored - w| of a parameter stored in ``dtype`` whose float32 master is
    within ``bound`` of the reference's ``w``: the master rounded to nearest in a narrower
    storage moves by at most u·|master| <= u·(|w| + bound) more (u: that dtype's unit
    roundoff; ZeRO-1/2 under mixed precision, NOTE [mixed precision] in meshlm/layout/precision.py)."""
    if dtype == torch.float32:
        return bound
    return bound + (torch.finfo(dtype).eps / 2) * (w.abs() + bound)


def ratio(err: Tensor, tol: Tensor) -> float:
    """max(|err| / tol) over the elements (0 where both are 0; inf where only tol is)."""
    err = err.abs()
    r = torch.where(tol > 0, err / tol.clamp_min(1e-45), torch.where(err > 0, math.inf, 0.0))
    return float(r.max()) if r.numel() else 0.0


def worst(err: Tensor, tol: Tensor) -> Optional[int]:
    """The flat index of the element with the largest |err| / tol (None for no elements)."""
    if not err.numel():
        return None
    err = err.abs().reshape(-1)
    tol = tol.reshape(-1)
    r = torch.where(tol > 0, err / tol.clamp_min(1e-45), torch.where(err > 0, math.inf, 0.0))
    return int(torch.argmax(r))
