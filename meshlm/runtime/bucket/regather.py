"""Eager ZeRO-3 blocks: gathered parameters freed after forward, re-gathered in backward."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.state import counting, eager
from meshlm.runtime.bucket.prefetch import Site, gather_locals
from meshlm.runtime.bucket.spec import BUCKETS


# NOTE [free and re-gather]
#     ZeRO-3 must not keep a block's gathered parameters from forward to backward, yet
#     autograd saves them (F.linear keeps its weight).  In eager mode a re-gathering block
#     does what FSDP2 does: when the block's forward returns, the storage of every gathered
#     tensor is freed (resized to 0 bytes; autograd's saved tensors are views of it and stay
#     valid objects), and the block's outputs pass through an identity autograd node
#     (``_Regather``) whose backward, which runs before any of the block's own backward
#     nodes, re-allocates those storages and all-gathers the parameters into them again.
#     Nothing is recomputed, and backward moves the same bytes as the re-gather by
#     checkpointing did.  When the block's backward is done (its gather's backward node has
#     run) the storages are freed again (``free_after_backward``), so backward, like forward,
#     holds one block's gathered parameters at a time (two with a prefetch in flight).
#     Under torch.compile (storage resizing does not trace) blocks
#     re-gather by checkpointing instead (NOTE [re-gather in backward] in lowering/policies.py), and under
#     train's activation checkpointing by that checkpoint's recompute.
class Freed:
    """The gathered tensors of one forward of one block, freed after it (NOTE [free and
    re-gather])."""

    def __init__(self, key: int, params, xs: Sequence[Tensor], local: bool, site: Site = None):
        self.key, self.params, self.local, self.site = key, tuple(params), local, site
        own = {compat.storage_key(compat.local_tensor(p).untyped_storage()) for p in params}  # NOTE [fake eager]
        self.slots: dict[int, tuple[torch.UntypedStorage, int, list]] = {}
        for j, x in enumerate(xs):
            st = x.untyped_storage()
            if compat.storage_key(st) in own or st.nbytes() == 0:  # a stored shard itself: never freed
                continue
            self.slots.setdefault(compat.storage_key(st), (st, st.nbytes(), []))[2].append((j, x))
        self.freed = False

    def free(self) -> None:
        for st, _n, _xs in self.slots.values():
            st.resize_(0)
        self.freed = True

    def regather(self) -> None:
        if not self.freed:
            return
        self.freed = False
        b = BUCKETS[self.key]
        with counting("gathering"), torch.no_grad():
            site = self.site if b.overlap and self.local and eager() else None
            ys = gather_locals(b, self.params, site)
            for st, n, xs in self.slots.values():
                st.resize_(n)
                for j, x in xs:
                    with compat.unsafe_preserve_version_counter(x):
                        x.copy_(ys[j])


class _Regather(torch.autograd.Function):
    """Identity on a block's outputs; its backward re-gathers the block's freed parameters."""

    @staticmethod
    def forward(ctx, freed: Freed, *outs):  # type: ignore[override]
        ctx.freed = freed
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.freed.regather()
        return (None, *grads)


def free_after_backward(freed: Freed, gathered) -> None:
    """Free the block's re-gathered tensors again once the block's backward is done: a hook
    on the node of its gather (``Gather``), which runs last in the block's backward (NOTE
    [free and re-gather]).  Without it every block's re-gathered parameters stayed alive
    until the end of backward (autograd's saved views keep the storages), so a ZeRO-3
    backward peaked at all of them at once, ZeRO-2's memory (found by
    benchmarks/memory_floor.py on 4 blocks)."""
    node = getattr(gathered[0], "grad_fn", None) if len(gathered) else None
    if node is not None and freed.slots:
        # Weakly: ``freed`` holds the gathered tensors, whose grad_fn is this node, so a
        # strong reference from the node's hook would be a cycle through C++ that the
        # garbage collector cannot see, keeping the block, and through the prefetch site
        # its whole model, alive after the model is deleted (tests/unit/test_run_state.py).
        # ``_Regather``'s node holds ``freed`` for as long as this backward can run.
        ref = weakref.ref(freed)

        def free_again(_grad_inputs, _grad_outputs) -> None:
            f = ref()
            if f is not None:
                f.free()

        node.register_hook(free_again)


def free_after(freed: Freed, out):
    """Free the block's gathered tensors and route ``out`` (a tensor or a tuple/list of
    them) through ``_Regather``."""
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    idx = [k for k, o in enumerate(flat) if isinstance(o, Tensor) and o.requires_grad]
    if not idx or not freed.slots:
        return out
    for k, o in zip(idx, _Regather.apply(freed, *[flat[k] for k in idx])):
        flat[k] = o
    freed.free()
    return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]
