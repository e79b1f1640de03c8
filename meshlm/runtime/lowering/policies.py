"""Checkpoint policies: which ops a re-gathering block saves and which it recomputes in
backward (NOTE [re-gather in backward]), and constraints kept active in a recompute."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshlm import _torch_compat as compat
from meshlm.core.state import RUN, scope


# NOTE [re-gather in backward]
#     ZeRO-3 frees a gathered parameter after its use in forward and gathers it again in
#     backward.  Autograd would instead keep the gathered tensor alive (F.linear saves its
#     weight), which is ZeRO-2's memory.  So each block whose parameters are gathered over a
#     data axis runs under selective activation checkpointing: every op's output is saved as
#     usual except the ops of those gathers (counted in the run state's ``gathering`` while ``AtUse``
#     gathers), which are recomputed, i.e. re-gathered, in backward.  It works the same in
#     eager mode and under torch.compile (SimpleFSDP's approach).  A block whose parameters
#     are bucketed (NOTE [block buckets] in meshlm/runtime/bucket/__init__.py) gathers them all in one op at its
#     entry, which the recompute re-runs: one flat all-gather per block in backward too.
#     The tp activation collectives' outputs are saved (``SAVED_COLLECTIVES``), so the
#     recompute re-runs only the gathers among the block's collectives.  This is the path of
#     compiled blocks and of unbucketed blocks; an eager bucketed block frees its gathered
#     parameters after forward and gathers them again in backward instead, recomputing
#     nothing (NOTE [free and re-gather] in meshlm/runtime/bucket/regather.py; ``EAGER_REGATHER``), and an eager
#     block under train's activation checkpointing is re-gathered by that checkpoint's
#     recompute alone.
def regather_policy(ctx, op, *args, **kwargs):
    if not RUN.gathering and ((op in SAVED_OPS and _has_dtensor(args)) or op in SAVED_COLLECTIVES or is_random(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _has_dtensor(args) -> bool:
    return any(isinstance(a, DTensor) for a in args)


# Which outputs a re-gathering block keeps for backward: its matmuls and attention (the
# expensive ops, as torchtitan's selective checkpointing keeps), never a gathered weight.
# Everything else (norms, activations, RoPE, views) is recomputed in backward.
#
# Why so few: checkpointing matches the ops of the recompute with those of the forward by
# per-op call counts, and it sees ops at two levels, a DTensor op and the plain-tensor ops
# DTensor runs inside it (local kernels, collectives, waits).  A saved op is not run again
# in the recompute, so whatever it ran inside is not seen again and later counts would
# shift onto the wrong saved outputs.  Matmuls and attention run no DTensor op inside, and
# plain-tensor ops are never saved, so a shift can only pair recompute with recompute.
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
for _name in (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
):
    if hasattr(torch.ops.aten, _name):
        SAVED_OPS.add(getattr(torch.ops.aten, _name).default)


# The activation collectives of tensor and sequence parallelism (the reductions of the
# o-projection and down-projection outputs, the all-gathers of the SP block inputs) are
# saved too, so that re-gathering the parameters does not re-run them: backward moves the
# same bytes as without checkpointing (torchtitan's selective policy also keeps its
# reduce-scatters).  These are plain-tensor ops that run nothing inside, so saving them
# cannot shift the recompute's op counts (above).  The parameter gathers are not saved
# (the run state's ``gathering``): re-running them is the point.
SAVED_COLLECTIVES = {
    getattr(compat.c10d_functional, _name).default
    for _name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "wait_tensor")
}


def is_random(op) -> bool:
    """A random op (meshlm.dropout's key draw, NOTE [dropout keys] in rng.py): saved, so
    that the recompute uses the forward's draw.  In eager mode the checkpoint's restored
    RNG state would redraw it equally; a compiled graph cannot recompute a random op (the
    partitioner then keeps the re-gathered parameters' mesh for backward and fails).  A
    plain-tensor op that runs nothing inside, so saving it cannot shift the recompute's op
    counts (above)."""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def regather_policy_local(ctx, op, *args, **kwargs):
    """The selective policy of a compiled local block (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py):
    plain tensors only, one dispatch level, so matmul and attention outputs are saved as
    they are."""
    if not RUN.gathering and (op in SAVED_OPS or is_random(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def regather_context_local():
    return create_selective_checkpoint_contexts(regather_policy_local)


def regather_context():
    return create_selective_checkpoint_contexts(regather_policy)


def keep_constraints(fn):
    """``fn`` with the constrain handler active now (inside the sharded forward) also
    active when torch.utils.checkpoint re-runs it in backward, outside the root forward.
    Without it, the recompute sees ``constrain`` as the identity: a Partial attention
    output stays Partial into the MLP, so the saved inputs differ from forward's and the
    weight gradients come out Partial over tp at full size (extra reduce-scatters)."""
    handler = RUN.handler

    def run(*args, **kwargs):
        if RUN.handler is handler:
            return fn(*args, **kwargs)
        with scope(handler=handler):
            return fn(*args, **kwargs)

    return run
