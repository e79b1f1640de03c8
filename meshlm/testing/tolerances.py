"""Every numerical tolerance of the parity tests, each with its justification.

Reference: the same weights on one device in fp32.  A sharded run differs from it only by
the *order* of floating-point additions: a matmul whose contraction dim is split adds
partial sums across ranks, an all-reduce adds per-rank terms in a different order, and
DTensor's math decompositions (cross-entropy, RMSNorm) reduce per shard first.  For a sum
of K fp32 terms computed in two different orders the difference is bounded by about
2·ceil(log2 K)·u·Σ|terms| (u = 2^-24 ≈ 6e-8) for the blocked/pairwise summation the CPU
kernels use; our largest reductions (batch·seq = 128 positions, vocab 256) give about
16·6e-8 ≈ 1e-6 relative to the magnitudes being summed.  We allow 10x that.
"""

# Loss: a mean over 128 positions of per-position losses of magnitude ~5.5.
LOSS_RTOL = 1e-5

# Gradients: compared element-wise with an absolute term scaled by the largest reference
# gradient entry of that parameter (gradients of near-zero entries carry the rounding of
# the sums that produce the large ones), and a relative term for the rest.
GRAD_RTOL = 1e-5
GRAD_ATOL_OF_MAX = 1e-5

# Optimizer step: AdamW is element-wise.  Given the *same* gradients, a sharded step must
# equal the one-device step exactly, so the step is checked by feeding the reference
# optimizer the gathered sharded gradients: no tolerance at all.
STEP_RTOL = 0.0
STEP_ATOL = 0.0

# One plain-SGD step checked against a reference that steps with its *own* one-device
# gradients (tests/dist/test_layout_properties.py: the reference borrows nothing from
# meshlm): p - lr*g differs from the reference by lr times the gradient difference (bounded
# by GRAD_RTOL and GRAD_ATOL_OF_MAX above, scaled by lr) plus the rounding of the update on
# each side, at most one ulp of the result each (2 * 2^-24 relative); we allow twice that.
SGD_STEP_RTOL = 2.0 ** -22

# Initialisation from a seed replays the one-device init order: exact.
INIT_ATOL = 0.0

# Global gradient norm (ShardedOptimizer.grad_norm) against the one-device norm: the norm is
# sqrt(sum g^2), and |d||g||| <= ||dg|| (triangle inequality), so its relative error is at
# most the gradients' own relative error in the 2-norm, which the argument above puts at
# about 1e-6 (fp32 summation order); the norm's float64 accumulation adds nothing at this
# scale.  Same 10x margin as the gradients.
NORM_RTOL = 1e-5

# Mixed precision: bf16 compute, fp32 reduction and accumulation (NOTE [mixed precision] in
# meshlm/precision.py).  Unit roundoffs (round to nearest): bf16 keeps 8 significant bits,
# u = 2^-8; fp32 keeps 24, u = 2^-24.
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24


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
