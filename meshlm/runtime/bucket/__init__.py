"""Per-block flat collectives: one all-gather and one reduce per block, not per parameter.

The package, each file one idea; imports flow down this list, never up:

    op.py        the autograd op (gather at a block's entry, reduce its gradients in
                 backward), overlapped reduction
    regather.py  eager ZeRO-3: gathered parameters freed after forward, re-gathered in backward
    prefetch.py  gathering a bucket's members, the next block's gather issued early
    local.py     blocks on local rows: inputs that qualify, outputs wrapped back
    flat.py      flat collectives (many tensors, one collective per mesh dim and kind)
    spec.py      what a bucket is (Member, Bucket), the process-wide table of buckets
                 (NOTE [process-wide tables] in meshlm/runtime/state.py)

Below them only meshlm's DTensor helpers and ``meshlm._torch_compat``.  The lowering
(``meshlm.runtime.lowering``) builds buckets and calls ``gather``; the optimizer calls
``redistribute_flat``.

NOTE [block buckets]
    A block's parameters are gathered at the block's entry in one flat collective per data
    mesh axis (the local shards concatenated into one buffer, all-gathered, and cut back into
    tensors), and their gradients are reduced the same way in backward: one flat
    reduce-scatter (or all-reduce) per data mesh axis for the whole block.  The bytes are
    those of the per-parameter collectives; the count drops from one per parameter to one per
    block and axis (FSDP2's and DDP's bucketing, at block granularity).

    Only the data axes (``dp``, ``fsdp``) are bucketed.  Other mesh axes (``tp``, ...) must
    be placed the same in storage and compute; a gradient that arrives Partial over them (the
    norm weights under sequence parallelism) is reduced per parameter after the data-axis
    reduce-scatter, so on the scattered shard.  A parameter whose storage -> compute move is
    anything else is left to the per-parameter path (``meshlm.runtime.lowering.atuse.AtUse``).

    NOTE [cp gradients in buckets]: a mesh with cp > 1 gets buckets even where it has no data
    axis (``fsdp_cp`` on cp=4): parameters are replicated over cp, so the bucket gathers
    nothing, but their gradients arrive Partial over cp and its backward sums them in one flat
    all-reduce per block, where the per-parameter path issued one blocking all-reduce per
    parameter (41 for llama_small; docs/cp.md, "Benchmark").

    Several data axes on one tensor dim (``embed: [dp, fsdp]``) are gathered inner axis
    first and reduce-scattered outer axis first, which keeps NOTE [shard order].

NOTE [local blocks]
    When the layout's compute is pure data parallelism on this mesh (every mesh axis splits
    the batch and nothing else, so every parameter is replicated in compute), a block's
    math on each rank is exactly the one-device block on that rank's rows.  Such a block runs
    on plain local tensors (FSDP2's and DDP's way): its batch-sharded DTensor inputs are
    unwrapped, the gathered parameters are plain tensors, and the outputs are wrapped back as
    batch-sharded.  That removes DTensor's per-op dispatch from the block (the bulk of the
    step's CPU overhead) while the collectives stay the same.  The gradient of a parameter
    used on local rows is this rank's share of a sum over all ranks, i.e. Partial over every
    mesh axis, which is what the bucket's backward reduces.  A block whose inputs are not all
    batch-sharded at run time falls back to DTensor compute.
"""

from meshlm.runtime.bucket import flat, local, op, prefetch, regather, spec
from meshlm.runtime.bucket.flat import redistribute_flat, waited
from meshlm.runtime.bucket.local import batch_sharded, wrap_local
from meshlm.runtime.bucket.op import Gather, gather, settle
from meshlm.runtime.bucket.prefetch import Prefetch
from meshlm.runtime.bucket.regather import Freed, free_after, free_after_backward
from meshlm.runtime.bucket.spec import BUCKETS, Bucket, Member, member, register

__all__ = [
    "BUCKETS",
    "Bucket",
    "Freed",
    "Gather",
    "Member",
    "Prefetch",
    "batch_sharded",
    "flat",
    "free_after",
    "free_after_backward",
    "gather",
    "local",
    "member",
    "op",
    "prefetch",
    "redistribute_flat",
    "regather",
    "register",
    "settle",
    "spec",
    "waited",
    "wrap_local",
]
