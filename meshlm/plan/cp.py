"""The formula planner's context-parallel terms (docs/cp.md, docs/plan.md "Context parallel").

NOTE [planned cp]
    A layout that maps ``seq`` to the ``cp`` mesh axis (of ``n`` ranks) splits every
    sequence for the whole model: each rank holds ``s/n`` tokens of every sequence from the
    input to the loss.  The formula planner follows it term by term:

    - activations: every per-token term of the block and of the output is per local token
      (``b·s/n``), the norm's output included (not gathered, unlike sequence parallelism); the
      RoPE tables stay whole (a replicated table meets the split activations).  One term is
      new: the context-parallel attention returns its output contiguous in (batch, heads,
      seq, head_dim), so the model's ``transpose(1, 2).reshape`` before the o-projection
      copies it, and that copy (B·q/t per local token) is what the o-projection saves.
    - attention's exchange, per layer and micro-batch, with K the bytes of this rank's keys
      as SDPA sees them (local tokens, batch rows, heads/t: our Llama repeats its kv heads
      before SDPA) and F = 4·numel of them (the float32 accumulator); the formula of NOTE [cp
      attention] in meshlm/runtime/cp/ring.py:
        ring       forward   2(n-1) sends of K           (and as many receives)
                   backward  2(n-1) sends of K, 2n of F  (and as many receives)
        allgather  forward   2 all-gathers of nK (logical)
                   backward  2 all-gathers of nK, 2 reduce-scatters of nF
      Under ``train.activation_checkpointing=full`` backward first re-runs the block's
      forward, its exchange included (phase backward).
    - the gradients: every parameter is replicated over cp and sees only this rank's tokens,
      so its gradient is Partial over cp and all-reduced over it (after the reduce-scatter
      over the data axes that shard it; a block's parameters in one bucket, one flat
      all-reduce per block, on meshes without a data axis too); the scalar loss is summed
      over cp as over the batch axes.
    tests/fake/test_plan_cp.py holds each against a counted step and the measured planner."""

from __future__ import annotations

from typing import Callable, Mapping

from meshlm.layout.context import ContextSpec
from meshlm.layout.rules import Layout
from meshlm.models import LlamaConfig

CP = "cp"


def cp_degree(lay: Layout, sizes: Mapping[str, int]) -> int:
    """The ranks one sequence is split over by context parallelism (1: none)."""
    return sizes.get(CP, 1) if CP in lay.compute.get("seq", ()) else 1


def context(lay: Layout) -> ContextSpec:
    return lay.context if lay.context is not None else ContextSpec()


def attention_comm(
    cfg: LlamaConfig, lay: Layout, sizes: Mapping[str, int], b: int, s: int, B: int, add: Callable, accum: int, ac: str
) -> None:
    """The exchange of context-parallel attention (NOTE [planned cp]), through ``add(kind,
    axis, phase, nbytes, what, count)``; ``b`` the batch rows of this rank, ``s`` the global
    sequence, ``B`` the compute dtype's bytes."""
    n = cp_degree(lay, sizes)
    if n <= 1:
        return
    t = 1
    for a in lay.compute.get("heads", ()):
        t *= sizes.get(a, 1)
    numel = b * (cfg.heads // t) * (s // n) * cfg.hd  # k as SDPA sees it: the kv heads repeated
    K, F = numel * B, numel * 4
    L = cfg.layers * accum
    runs = [("forward", L), ("backward", L)] if ac == "full" else [("forward", L)]  # full: forward re-run
    variant = context(lay).attention
    for phase, k in runs:
        if variant == "ring":
            for kind in ("send", "recv"):
                add(kind, CP, phase, K, "cp ring: keys and values", 2 * (n - 1) * k)
        else:
            add("all_gather", CP, phase, n * K, "cp all-gather: keys and values", 2 * k)
    if variant == "ring":
        for kind in ("send", "recv"):
            add(kind, CP, "backward", K, "cp ring: keys and values", 2 * (n - 1) * L)
            add(kind, CP, "backward", F, "cp ring: key and value gradients (float32)", 2 * n * L)
    else:
        add("all_gather", CP, "backward", n * K, "cp all-gather: keys and values", 2 * L)
        add("reduce_scatter", CP, "backward", n * F, "cp reduce-scatter: key and value gradients (float32)", 2 * L)
