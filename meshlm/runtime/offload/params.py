"""Each block's parameters on another tier between uses, fetched ahead of use.

NOTE [offloaded parameters]
    With ``offload.params`` on ``host`` or ``disk``, the stored parameters (this rank's
    shards, as the layout's ``params`` section keeps them) of every outer ``@meshlm.block``
    live on the tier except while the block runs: its forward, its backward, and its chunk
    of the optimizer step (NOTE [offloaded step] in optimizer.py).  Around each call of a
    block (outside any compiled graph: the block's class becomes ``Offloaded<its class>``,
    whose ``__call__`` wraps ``nn.Module.__call__``; NOTE [attachments] in
    meshlm/runtime/hooks.py):

    - before its forward: its parameters are swapped in (NOTE [swapped storage] in
      store.py), and the next block's are prefetched (read in a background thread while
      this block computes);
    - after its forward: swapped out again; its outputs pass through an identity whose
      backward swaps them back in (and prefetches the previous block's) before any of the
      block's own backward runs, and its inputs through one whose backward swaps them out
      once the block's backward has made the gradient of its inputs.

    Autograd may have saved a parameter for backward (a weight a matmul reads): the saved
    tensor is the parameter itself, whose storage is refilled with the same bytes before the
    block's backward reads it (a read into storage leaves autograd's version counter alone),
    so gradients are bit for bit those of the run without offload.  A recompute in backward
    (activation checkpointing) runs inside the block's backward, with the parameters in.
    Without autograd (validation) a block's parameters go out right after its forward.

    ``meshlm train`` builds the model onto the tier: ``meshlm.shard(..., after_block=
    Offload.spill)`` moves each block's parameters out as soon as they are made, before the
    next block's are, so the whole model is never in memory at once (otherwise building it is
    the run's peak once everything is offloaded: docs/offload.md).

    Parameters outside blocks (embeddings, the head, a final norm) stay on the device.  The
    optimizer must update parameters in place (their master is the parameter), so that the
    step moves one block's parameters in and out with its state: layouts whose optimizer
    keeps copies (zero1, zero2, or bf16 storage with float32 masters) are refused.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from meshlm import _torch_compat as compat
from meshlm.core.annotate import outer_blocks
from meshlm.core.errors import ConfigError
from meshlm.core.tree import map_tensors
from meshlm.runtime import hooks
from meshlm.runtime.memory import local_data
from meshlm.runtime.offload.store import Swapper, owns_storage

OFFLOAD_ATTR = "_meshlm_param_offload"  # a block's (ParamOffload, index), in its __dict__


class ParamOffload:
    """The swapped parameters of a model's blocks (NOTE [offloaded parameters])."""

    def __init__(self, model: nn.Module, swapper: Swapper, prefetch: bool = True, only=None):
        """``only``: the indices (in block order) of the blocks to offload; default all
        (inference placement streams only the blocks that do not fit, meshlm/infer/placement.py)."""
        blocks = outer_blocks(model)
        if only is not None:
            blocks = [blocks[i] for i in only]
        if not blocks:
            raise ConfigError(
                f"offload.params={swapper.tier}: parameters are moved block by block, and "
                f"{type(model).__name__} has no @meshlm.block modules; mark its repeated layers with "
                "@meshlm.block, or set offload.params=device"
            )
        self.swapper = swapper
        self.groups: list[list[Tensor]] = []
        for blk in blocks:
            if OFFLOAD_ATTR in blk.__dict__:
                raise ConfigError(f"offload.params: block {type(blk).__name__} is offloaded already")
            # a parameter moved out as the model was built (Offload.spill) is on the tier already
            self.groups.append([t for t in map(local_data, blk.parameters()) if owns_storage(t) or swapper.is_out(t)])
            hooks.set_attrs(blk, hooks.OFFLOAD, **{OFFLOAD_ATTR: (self, len(self.groups) - 1)})
            hooks.swap_class(blk, hooks.OFFLOAD, hooks.derived_class(type(blk), "Offloaded", {"__call__": _call}))
        self.blocks = blocks
        self._managed = {id(t) for g in self.groups for t in g}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshlm-prefetch") if prefetch else None
        self.prefetched = 0  # blocks whose parameters were read ahead of use
        # in memory until the optimizer (which reads them to make its masters) moves them out:
        # ShardedOptimizer(offload_params=...), or swap_out_all()

    def swap_out_all(self) -> None:
        for i in range(len(self.groups)):
            self.swap_out(i, clean=False)

    def close(self) -> None:
        """Stop the read-ahead thread (after waiting for a read it has started)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def release(self) -> None:
        """Every block's parameters in memory for good, forgotten by the tier (their files
        removed), and the blocks detached: they are called as they were before (what
        ``meshlm.unshard`` does first)."""
        self.close()
        for i, group in enumerate(self.groups):
            self.swap_in(i)
            for t in group:
                self.swapper.forget(t)
        self.groups = [[] for _ in self.groups]
        self._managed = set()
        for blk in self.blocks:
            hooks.detach(blk, hooks.OFFLOAD)

    def manages(self, p: Tensor) -> bool:
        return id(local_data(p)) in self._managed

    def swap_in(self, i: int) -> None:
        for t in self.groups[i]:
            self.swapper.swap_in(t)

    def swap_out(self, i: int, clean: bool = True) -> None:
        """Block ``i``'s parameters out; ``clean``: unchanged since they came in (forward and
        backward do not write them), so nothing is written again."""
        for t in self.groups[i]:
            self.swapper.swap_out(t, clean=clean)

    def prefetch(self, i: int) -> None:
        """Start reading block ``i``'s parameters in the background (a no-op out of range,
        without a prefetch thread, or when they are in)."""
        if self._pool is None or not 0 <= i < len(self.groups):
            return
        if any(self.swapper.swap_in_async(t, self._pool) for t in self.groups[i]):
            self.prefetched += 1

    def tensors(self, params) -> list[Tensor]:
        """The managed local tensors among ``params``."""
        return [local_data(p) for p in params if self.manages(p)]

    # -- around a block's call (NOTE [offloaded parameters])
    def call(self, blk: nn.Module, i: int, args: tuple, kwargs: dict) -> Any:
        if compat.in_backward():  # a recompute of the block: its backward has swapped it in
            return nn.Module.__call__(blk, *args, **kwargs)
        self.swap_in(i)
        self.prefetch(i + 1)
        track = torch.is_grad_enabled()
        if track:  # out again once the block's backward has made its inputs' gradients
            args, kwargs = _through(functools.partial(self.swap_out, i), (args, kwargs))
        try:
            out = nn.Module.__call__(blk, *args, **kwargs)
        finally:
            self.swap_out(i)
        if track:  # in again (and the previous block's read ahead) before the block's backward
            out = _through(functools.partial(self._before_backward, i), out)
        return out

    def _before_backward(self, i: int) -> None:
        self.swap_in(i)
        self.prefetch(i - 1)


def refuse_copies(off: "ParamOffload", copies: list) -> None:
    """Raise ConfigError when the optimizer would keep copies (``copies``: FQNs) of offloaded
    parameters: ZeRO-1/2 masters or float32 masters of narrower storage cannot be refreshed
    chunk by chunk (NOTE [offloaded parameters])."""
    if copies:
        raise ConfigError(
            f"offload.params={off.swapper.tier}: the optimizer keeps a copy of parameter `{copies[0]}` "
            f"(and {len(copies) - 1} more): ZeRO-1/2 masters or float32 masters of lower-precision storage, "
            "which offloaded parameters cannot be refreshed from chunk by chunk. Use a layout that updates "
            "parameters in place (ddp, fsdp, hsdp, tp, fsdp_tp, ...) or offload.optimizer only"
        )


def _through(action, tree):
    """``tree`` (containers of tensors, meshlm.core.tree) with its tensors that need gradients
    passed through one ``_OnBackward`` running ``action``."""
    found: list[Tensor] = []
    map_tensors(tree, lambda _p, t: found.append(t) or t, strict=False)
    need = list({id(t): t for t in found if t.requires_grad}.values())
    if not need:
        return tree
    new = {id(a): b for a, b in zip(need, _OnBackward.apply(action, *need))}
    return map_tensors(tree, lambda _p, t: new.get(id(t), t), strict=False)


class _OnBackward(torch.autograd.Function):
    """Identity on tensors; ``action()`` runs when backward reaches them (before the
    gradients pass on to what made them)."""

    @staticmethod
    def forward(ctx, action, *xs):
        ctx.action = action
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.action()
        return (None, *grads)


def _call(self, *args, **kwargs):
    """An offloaded block's ``__call__`` (NOTE [offloaded parameters])."""
    off, i = self.__dict__[OFFLOAD_ATTR]
    return off.call(self, i, args, kwargs)
