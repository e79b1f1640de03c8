"""Gradients on another tier from the moment backward makes them until the step reads them.

NOTE [offloaded gradients]
    With ``offload.grads`` on ``host`` or ``disk``, a parameter's gradient does not stay in
    ``.grad`` through the backward pass: a post-accumulate-grad hook on each parameter the
    optimizer steps takes it as soon as autograd has stored it (after the layout's reduction
    made it: a block's reduce-scatter under FSDP, its all-reduce under DDP) and swaps it out
    (NOTE [swapped storage] in store.py).  The next micro-batch's gradient of the same
    parameter is added into it: swapped in, added, swapped out.  So the backward pass holds
    at most the gradients that are being made, not the whole model's, when it ends (the end
    of backward is where a step's memory peaks once activations are freed: ZeRO-Offload
    moves gradients off the device during backward for this reason).

    ``ShardedOptimizer.reduce_grads`` then makes each master's ``.grad`` from the swapped
    gradient, chunk by chunk (a ZeRO-1 chunk is swapped in, reduce-scattered and its shard
    swapped out); the gradient norm, clipping and the loss scaler's unscale visit one
    gradient at a time (``each``); the optimizer's chunked step (NOTE [offloaded step] in
    optimizer.py) swaps a chunk's gradients in with its state.  Multiplying every gradient
    (the loss scaler's unscale, clipping) does not read and rewrite them: the factor is kept
    and applied each time a gradient comes in (``GradOffload.scale``), so a clipped step
    reads the gradients twice (the norm, the step) and writes them once.  The sums are the same
    additions in the same order as autograd's accumulation into ``.grad``, so an offloaded
    run's gradients and weights equal the run's without offload bit for bit
    (tests/dist/test_offload_grads.py).

    Between backward and ``reduce_grads`` a parameter's ``.grad`` is None (its gradient is
    on the tier); readers go through the optimizer (``opt.reduce_grads()``, then
    ``opt.masters()[fqn].grad`` inside ``opt.resident()``).  Main gradients (bf16 storage
    under ZeRO-1/2, NOTE [main grads] in meshlm/runtime/main_grad.py) bypass ``.grad``: main_grad's
    add hands each reduced float32 gradient here instead (the parameter's ``SINK``), and it
    is accumulated the same way; ``main_grad`` stays None.  Inside pipeline stages (NOTE
    [pipelined step] in meshlm/runtime/pipeline/pipe.py) each micro-batch's unreduced gradient is
    accumulated on the tier the same way, and reduced once, at the step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.runtime import main_grad
from meshlm.runtime.bucket import redistribute_flat
from meshlm.runtime.lowering import shard_state
from meshlm.runtime.offload.store import Swapper, owns_storage


class GradOffload:
    """The swapped gradients of a ``ShardedOptimizer``'s parameters (NOTE [offloaded gradients])."""

    def __init__(self, opt, swapper: Swapper):
        st = shard_state(opt.model)
        mains = [p for _f, p, _m in opt._pairs if st.grad_dtype is not None and st.grad_dtype != p.dtype]
        self.swapper = swapper
        self.acc: dict[int, Tensor] = {}  # id(param) -> its gradient so far this step (DTensor or tensor), swapped
        self.held: list[Tensor] = []  # every plain tensor swapped this step, alive until zero_grad
        self.pending: dict[int, list[float]] = {}  # id(tensor) -> factors not in its copy on the tier
        self.dirty: set[int] = set()  # id(tensor): in memory and changed since its copy on the tier
        # main gradients (NOTE [main grads]) come to accumulate() from main_grad's add; the
        # others from autograd's .grad, through a hook
        self._mains = mains
        for p in mains:
            setattr(p, main_grad.SINK, self)
        main_ids = {id(p) for p in mains}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._take) for _f, p, _m in opt._pairs if id(p) not in main_ids
        ]
        self.peak_resident = 0  # the most gradient bytes in memory at once inside the hook (for tests)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self._mains:
            setattr(p, main_grad.SINK, None)
        self._mains = []

    # -- during backward
    def _take(self, p: Tensor) -> None:
        """The hook: ``p.grad`` (just accumulated) goes to the tier, added to what is there."""
        g = p.grad
        p.grad = None
        if g is not None:
            self.accumulate(p, g)

    def accumulate(self, p: Tensor, g: Tensor) -> None:
        """Add ``p``'s gradient ``g`` (just made) into its gradient on the tier."""
        local = _settled(g)
        with torch.no_grad():
            acc = self.acc.get(id(p))
            if acc is None:
                if not owns_storage(local):
                    local = local.clone(memory_format=torch.contiguous_format)
                acc = self.acc[id(p)] = _wrap_like(local, g)
                local = _local(acc)  # from_local may wrap a view: the wrapper's own tensor is what moves
                self.held.append(local)
            else:
                loc = _local(acc)
                self.swapper.swap_in(loc)
                loc.add_(local)
                local = loc
            self.peak_resident = max(self.peak_resident, 2 * local.numel() * local.element_size())
            self.swapper.swap_out(local)

    def grad_of(self, p: Tensor) -> Optional[Tensor]:
        """``p``'s accumulated gradient of this step (swapped out), or None."""
        return self.acc.get(id(p))

    def put(self, g: Tensor) -> Tensor:
        """``g`` (a master's gradient made by ``reduce_grads``) swapped out and kept; returns it."""
        if not owns_storage(_local(g)):
            g = _wrap_like(_local(g).clone(memory_format=torch.contiguous_format), g)
        local = _local(g)
        self.held.append(local)
        self.swapper.swap_out(local)
        return g

    def reduce(self, opt) -> None:
        """``opt.reduce_grads()`` with the gradients here: each master's ``.grad`` made from
        its parameter's swapped gradient, chunk by chunk (NOTE [optimizer chunks] in
        meshlm/runtime/optim/chunks.py), each chunk's gradients swapped in for its reduction and the results
        swapped out."""
        assert not self.pending and not self.dirty, "gradients scaled before they were reduced"
        moving: dict = {}
        for (_fqn, p, m), key in zip(opt._pairs, opt._keys):
            g = self.grad_of(p)
            if m is p:
                p.grad = g
            elif g is None:
                m.grad = None
            elif tuple(g.placements) != tuple(m.placements) or g.dtype != m.dtype:
                moving.setdefault(key, []).append((p, m))
            else:
                m.grad = g
        for key, pms in moving.items():
            gs = [self.grad_of(p) for p, _m in pms]
            with self.resident(gs):
                gs = [g.to(m.dtype) for g, (_p, m) in zip(gs, pms)]
                out = redistribute_flat(gs, [m.placements for _p, m in pms], [key] * len(pms))
                del gs
                for (_p, m), g in zip(pms, out):
                    m.grad = self.put(g)

    # -- readers
    def bring_in(self, t: Tensor) -> None:
        """Plain tensor ``t`` in memory, with the factors its copy on the tier lacks applied."""
        if self.swapper.is_out(t):
            self.swapper.swap_in(t)
            for f in self.pending.get(id(t), ()):
                t.mul_(f)

    def send_out(self, t: Tensor) -> None:
        """Plain tensor ``t`` back to the tier: written if it changed, else its copy kept."""
        if id(t) in self.dirty:
            self.dirty.discard(id(t))
            self.pending.pop(id(t), None)  # the copy written holds them
            self.swapper.swap_out(t, clean=False)
        else:
            self.swapper.swap_out(t, clean=True)

    def scale(self, grads, factor: float) -> None:
        """Multiply ``grads`` (plain tensors) by ``factor`` (the loss scaler's unscale,
        clipping): a gradient on the tier is not read and rewritten for it; the factor is
        kept and applied, in order, each time it comes in (the same multiplications as on
        a gradient in memory, so the same bits)."""
        for t in grads:
            if self.swapper.is_out(t):
                self.pending.setdefault(id(t), []).append(factor)
            else:
                t.mul_(factor)
                self.dirty.add(id(t))

    @contextlib.contextmanager
    def resident(self, grads) -> Iterator[None]:
        """``grads`` (tensors or DTensors, None skipped) in memory inside the context, out
        after it."""
        locs = [_local(g) for g in grads if g is not None]
        for t in locs:
            self.bring_in(t)
        try:
            yield
        finally:
            for t in locs:
                self.send_out(t)

    def each(self, grads) -> Iterator[Tensor]:
        """Each gradient of ``grads`` in memory in turn (one at a time)."""
        for g in grads:
            with self.resident([g]):
                yield g

    def release(self) -> None:
        """The step's gradients are done with (``zero_grad``): their copies on the tier go."""
        for t in self.held:
            self.swapper.forget(t)
        self.held = []
        self.acc = {}
        self.pending = {}
        self.dirty = set()


def _settled(g: Tensor) -> Tensor:
    """The local tensor of gradient ``g``, waited for if its reduction is in flight (NOTE
    [overlapped reduction] in meshlm/runtime/bucket/op.py)."""
    local = compat.local_tensor(g) if isinstance(g, DTensor) else g
    if compat.in_flight(local):
        local = local.wait()
    return local


def _local(g: Tensor) -> Tensor:
    return compat.local_tensor(g) if isinstance(g, DTensor) else g


def _wrap_like(local: Tensor, g: Tensor) -> Tensor:
    if not isinstance(g, DTensor):
        return local
    return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride())
