"""Where the optimizer's flat collectives are cut, and masters that are views.

NOTE [optimizer chunks]) is such a tensor, so under a fused optimizer
    ``_step_local`` steps a contiguous copy of it and writes the result back into the view
    (tests/unit/test_optim_step.py).

NOTE [whole-tensor step]
    An optimizer not known to be elementwise (a factored or matrix one: Adafactor's row and
    column statistics, Muon's orthogonalisation, Shampoo) needs each parameter whole: a
    shard's update depends on the other shards, and DTensor dispatch of such a step fails
    (an in-place op on a norm's partial result) or would be wrong on shards.  Its masters are
    therefore replicated over the whole mesh, whatever the layout's ``optimizer`` section
    says: the gradient is reduced to a whole tensor (an all-reduce, or an all-gather of
    shards), every rank steps the whole parameter with whole state, and the parameter is
    refreshed from it as stored (a local slice).  The same numbers as one device; the memory
    and optimizer work of DDP (a full master and its state on every rank).

NOTE [optimizer chunks]
    ZeRO-1/2 move the whole model at each step: the gradients' reduce-scatter (ZeRO-1) and
    the updated shards' all-gather.  They are flat collectives (``bucket.redistribute_flat``)
    chunked by block, the granularity of the block buckets: one collective per data axis
    for each block, and for the parameters outside blocks one per group of them that fits
    in the largest block's bytes (one per parameter where each is larger), so no temporary
    buffer is larger than a block or the largest parameter (DDP's 25 MB buckets and
    DeepSpeed's bucket sizes bound theirs the same way); two chunks' collectives are in
    flight at once (NOTE [reductions in flight] in meshlm/runtime/bucket/flat.py).  ``ShardedOptimizer(...,
    bucket_mb=X)`` (as DeepSpeed's ``reduce_bucket_size`` and ``allgather_bucket_size``)
    merges chunks, in order, until each holds at least X MiB of whole parameters: fewer,
    larger collectives, larger temporary buffers, the same bytes (``meshlm plan`` counts
    the default chunks).  The all-gather writes into the parameters directly.  A same-dtype
    master of a parameter stored whole (ZeRO-1/2) is a view of this rank's block of the
    parameter, not a copy: the optimizer updates that block in place and the all-gather
    brings the others (ZeroRedundancyOptimizer's memory).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshlm import _torch_compat as compat


def shard_view(p: DTensor, opt_pl: tuple) -> Optional[DTensor]:
    """The master of ``p`` under optimizer placements ``opt_pl`` as a view of ``p``'s own
    storage (NOTE [optimizer chunks]), or None when ``opt_pl`` does not only split
    what ``p`` stores whole, or this rank's optimizer block is not inside its stored one."""
    from meshlm.core.errors import LayoutError
    from meshlm.runtime.lowering import local_box

    mesh = p.device_mesh
    for sp, op in zip(p.placements, opt_pl):
        if sp != op and not (sp.is_replicate() and isinstance(op, Shard)):
            return None
    try:
        sbox, obox = local_box(p.shape, mesh, p.placements), local_box(p.shape, mesh, opt_pl)
    except LayoutError:  # uneven shards: the copy path handles (or reports) them
        return None
    local = compat.local_tensor(p).detach()
    for d, ((s0, _sn), (o0, on)) in enumerate(zip(sbox, obox)):
        if o0 < s0 or o0 + on > s0 + local.shape[d]:
            return None
        local = local.narrow(d, o0 - s0, on)
    return DTensor.from_local(local, mesh, opt_pl, run_check=False, shape=p.shape, stride=p.stride())


def chunk_keys(model: nn.Module, params: list, bucket_bytes: Optional[int] = None) -> list:
    """Per parameter, the chunk of the optimizer's flat collectives it goes in: its outer
    block, or outside blocks a chunk of its own or shared (below); with ``bucket_bytes``,
    such chunks (in order of their first parameter) merged until a merged chunk holds at
    least that many bytes of whole parameters (NOTE [optimizer chunks])."""
    from meshlm.core.annotate import outer_blocks

    where = {}
    blocks = outer_blocks(model)
    for n, blk in enumerate(blocks):
        for q in blk.parameters():
            where.setdefault(id(q), n)
    # Parameters outside blocks share a chunk while it stays within the largest block's
    # bytes (the embedding, final norm and head of a small model: one collective, not three;
    # a large vocabulary's tables stay one chunk each).
    cap = max((sum(q.numel() * q.element_size() for q in blk.parameters()) for blk in blocks), default=0)
    outside = iter(outside_chunks([p.numel() * p.element_size() for p in params if id(p) not in where], cap))
    keys = [where[id(p)] if id(p) in where else ("outside", next(outside)) for p in params]
    if bucket_bytes is None:
        return keys
    sizes: dict = {}  # chunk -> bytes, in order of first appearance
    for p, key in zip(params, keys):
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
    merged, group, size = {}, 0, 0
    for key, nbytes in sizes.items():
        if size >= bucket_bytes:  # close the merged chunk once it is full
            group, size = group + 1, 0
        merged[key] = ("bucket", group)
        size += nbytes
    return [merged[key] for key in keys]


def outside_chunks(nbytes: Sequence[int], cap: int) -> list[int]:
    """The chunk of each parameter outside the blocks, given their bytes in order:
    consecutive ones share a chunk while it holds at most ``cap`` bytes (one each where a
    parameter is larger; NOTE [optimizer chunks]).  ``meshlm plan`` counts the same chunks."""
    out, group, size = [], 0, 0
    for n in nbytes:
        if size and size + n > cap:
            group, size = group + 1, 0
        size += n
        out.append(group)
    return out
