"""The tolerances only the tests need, with their justification; the rest, the derivations
``meshlm diff`` needs too, are the library's (meshlm/train/tolerances.py: the float32
argument, NOTE [tolerances after steps], NOTE [mixed-precision parity]) and are imported here,
so that ``harness.tolerances`` stays the one module the tests name.

NOTE [invariance tolerance]
    The training loop's curves (tests/dist/test_train_invariance.py: 12 steps of
    llama_tiny, AdamW at lr 3e-3, against one process).  Each step's loss differs between
    layouts only by the order of fp32 additions (~1e-6 relative per reduction, meshlm/train/tolerances.py;
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
    the loss gives 12 x 2.4e-4 = 2.9e-3; with the loss curve's slack (2.5x) INVARIANCE_NORM_RTOL =
    7e-3.  A gradient averaged twice or a missing 1/grad_accum doubles or halves the norm:
    a relative error of 0.5 to 1, over 1000 times FIRST_NORM_RTOL.
"""

from __future__ import annotations

from meshlm.train.tolerances import (  # noqa: F401 (the library's tolerances, under the names the tests use)
    BF16_UNIT_ROUNDOFF,
    FP32_UNIT_ROUNDOFF,
    GRAD_ATOL_OF_MAX,
    GRAD_RTOL,
    HF_LOGIT_ATOL,
    HF_LOGIT_RTOL,
    HF_LOSS_RTOL,
    INIT_ATOL,
    LOSS_RTOL,
    NORM_RTOL,
    STEP_ULPS,
    StepBounds,
    U,
    activation_tol,
    bf16_grad_tol,
    bf16_loss_tols,
    bf16_split_factor,
    grad_noise_floor,
    grad_tol,
    norm_and_bound,
    ratio,
    stored_bound,
)

# One plain-SGD step checked against a reference that steps with its *own* one-device
# gradients (tests/dist/test_layout_properties.py: the reference borrows nothing from
# meshlm): p - lr*g differs from the reference by lr times the gradient difference (bounded
# by GRAD_RTOL and GRAD_ATOL_OF_MAX above, scaled by lr) plus the rounding of the update on
# each side, at most one ulp of the result each (2 * 2^-24 relative); we allow twice that.
SGD_STEP_RTOL = 2.0**-22

# Buffers after each step (NOTE [buffers] in meshlm/runtime/lowering/buffers.py), float ones against
# the largest entry of the reference's: a running mean is a mean of activations, averaged over
# the ranks in another order (fp32 summation, about 1e-6 relative as for the gradients) and
# produced by weights that differ from the reference's by the parameter bounds (about 1e-6
# relative after a few steps); 10x margin.  Integer buffers (counters) are exact.
BUFFER_ATOL_OF_MAX = 1e-5

# Logits of decoding with a KV cache against one forward over the whole sequence, the same
# model (tests/unit/test_generate.py).  The ops are the same; attention differs in what
# SDPA is given (the cached keys with a mask or none, against the whole sequence with
# is_causal), so its kernel blocks the softmax and the sums over keys differently: a few u
# (6e-8) relative to the terms, through 2 layers and a head whose logits are up to 0.7
# (Llama) and 3.4 (GPT-2).  Measured worst |diff|: 2.1e-7 (Llama), 2.7e-7 (GPT-2); we allow
# 1e-6 + 1e-5 relative.  A wrong position (RoPE or learned) or a pad slot attended to moves
# logits by 1e-3 or more.
KV_LOGIT_RTOL = 1e-5
KV_LOGIT_ATOL = 1e-6


def accumulated_grad_atol(abs_terms_sum, terms: int):
    """Elementwise bound on |accumulated gradient - fp32 one-device gradient| for a linear
    layer y = x W^T computed in bf16 (tests/dist/test_mixed_precision.py, the probe), whose
    gradient is the sum of ``terms`` = ranks x micro-batches contributions G_k = d_k^T x_k.

    Derivation.  Each G_k is a bf16 matmul: its inputs are exact in bf16 (x is drawn
    bf16-representable, and at zero logits the loss gradient d is (softmax - onehot)/n =
    {1/4, -3/4} times a power of two), products and the kernel's fp32 accumulation are exact
    for one token per term, and the output is rounded once to bf16: |Ĝ_k - G_k| <= u16·|G_k|
    elementwise (in general, with T tokens per term, u16·Σ_t|d_t x_t| + T·u32·Σ_t|d_t x_t|;
    T = 1 here).  The cast's backward returns Ĝ_k in fp32; the K terms are then summed in
    fp32 (all-reduce over the ranks, accumulation over micro-batches in ``.grad``): recursive
    summation adds at most (K-1)·u32·Σ_k|Ĝ_k| (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 4.4, to first order).  Together, to first order:

        |g - g_ref| <= (u16 + (K-1)·u32) · Σ_k |G_k|      (``abs_terms_sum`` = Σ_k |G_k|)

    The second-order terms are below u16·u32·K relative to the bound: nothing at this scale.
    An implementation that sums in bf16 instead (reduces in bf16, or accumulates ``.grad`` in
    bf16) rounds each of the K-1 partial sums to 8 bits: up to (K-1)·u16·Σ|G_k| more, so a
    bound of one u16 catches it once K-1 > 1 roundings lose in the same direction (the test
    makes them: small micro-batch gradients swamped by one large one, as in practice)."""
    return (BF16_UNIT_ROUNDOFF + (terms - 1) * FP32_UNIT_ROUNDOFF) * abs_terms_sum


# float16 (with loss scaling) against bfloat16 training, step by step, from the same fp32
# master weights (tests/dist/test_train_cli.py): each step's loss differs by the forward's
# rounding, dominated by bf16's (u = 2^-8 ≈ 3.9e-3 per rounding, fp16's 2^-11 is 8x finer):
# the logits carry a few such relative errors of random sign, and the mean cross-entropy
# moves by less than the logits' relative error (its gradient in the logits has entries
# below 1/n per token, and the logits are O(1)).  Over a few steps the two trajectories
# drift only by those per-step differences (AdamW normalises the update's size).  We allow
# 2.5·u16(bf16) = 1e-2; measured: at most 2e-4 over 8 steps of llama_tiny on 2 ranks.
FP16_VS_BF16_LOSS_RTOL = 1e-2

# The training loop's loss and gradient-norm curves over 12 steps (NOTE [invariance tolerance]).
INVARIANCE_RTOL = 3e-4
FIRST_NORM_RTOL = 3e-4
INVARIANCE_NORM_RTOL = 7e-3  # the gradient-norm curve (not NORM_RTOL: one norm, one step)

# The training loop's loss and gradient-norm curves over 12 steps (NOTE [invariance tolerance]).
INVARIANCE_RTOL = 3e-4
FIRST_NORM_RTOL = 3e-4
INVARIANCE_NORM_RTOL = 7e-3  # the gradient-norm curve (not NORM_RTOL: one norm, one step)


# NOTE [cp attention tolerance]
#     Context-parallel attention (meshlm/runtime/cp/, tests/dist/test_cp_attention.py) against
#     plain SDPA over the whole sequence on one process, float32.  Both compute the same
#     softmax; the cp side cuts the keys into blocks (one per source rank, NOTE [cp attention]
#     in meshlm/runtime/cp/ring.py) and merges them by logsumexp.  What differs: (a) the order
#     of the sums over keys (an output is sum_j p_ij v_j, dq a sum over keys, dk and dv sums
#     over queries that now lie on n ranks), about 2 log2(S) u of the summed magnitudes for
#     pairwise sums, 1.3e-6 at S = 2048; (b) the merge weights exp(lse_j - lse), whose
#     exponents carry the rounding of lse (a few u times |lse|, and |lse| <= log S + the
#     largest score, about 10 here), about 2e-6 relative per weight, and the same error
#     enters the backward's P = exp(scores - lse).  Together a few 1e-6 of the magnitudes
#     involved: the output is held to ``activation_tol`` and dq, dk, dv to ``grad_tol``
#     (1e-5 relative plus 1e-5 of the tensor's largest entry, meshlm/train/tolerances.py).
#     bfloat16: a row's keys are split over at most n blocks, each rounded once to bf16, then
#     merged in float32 and cast once; dk, dv, dq are n shares rounded to bf16 and added in
#     float32: at most 2n - 1 roundings where the reference rounds once, the split-sum bound
#     of NOTE [mixed-precision parity] with R = n (``bf16_grad_tol``, its scale measured as
#     plain bf16 SDPA against float32 SDPA on the same bf16 inputs).
#     Measured (worst |cp - sdpa| / tolerance over every case of the test, both variants):
#     float32 0.036 (2 ranks, S = 64), 0.045 (4 ranks, S = 96), 0.028 (4 ranks, S = 2,048);
#     bf16 0.19 (4 ranks, S = 128).  Bugs: the head and tail chunks of another rank swapped
#     in the balanced schedule, blocks merged without the logsumexp rule (the last block
#     overwriting the others), the ring's dk/dv accumulator not brought home, the all-gather's
#     dk/dv not reduce-scattered: each fails every case it reaches (on 4 ranks, causal and
#     balanced: 6e4, 3e5, 1e5 and 4e4 times the tolerance).
