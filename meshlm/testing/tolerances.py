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
