"""Optimizer state and master weights on another tier, stepped chunk by chunk.

NOTE [offloaded step]
    With ``offload.optimizer`` on ``host`` or ``disk``, each master that is a tensor of its
    own (fp32 masters of bf16 parameters; the copies ZeRO-1/2 make) and every optimizer
    state tensor except the step counters live on that tier between steps (NOTE [swapped
    storage] in meshlm/runtime/offload/store.py).  ``ShardedOptimizer.step`` then runs the torch
    optimizer one chunk at a time, in the chunks of its flat collectives (one per block,
    NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py): the chunk's state is swapped in, the
    chunk's masters are stepped (on the host of a CPU-only machine, where the state lives),
    the parameters' new values are taken, and the state is swapped out before the next
    chunk comes in, so at most one block's optimizer state is in memory at once.  On the
    ``host`` tier with the parameters on an accelerator the chunk is stepped on the host
    instead, and the state never comes to the device (NOTE [host step] in host_step.py).  The
    optimizer's first step creates the state; it goes to the tier as soon as its chunk is
    stepped.

    Stepping chunk by chunk is the same arithmetic as one call over all parameters: the
    elementwise optimizers' update of a tensor does not depend on which others are updated
    in the same call (per tensor step counts and bias corrections), so an offloaded run's
    weights equal the same run's without offload bit for bit (tests/test_offload.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Optional

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.runtime.memory import local_data
from meshlm.runtime.offload.store import Swapper


class OptimizerOffload:
    """The swapped part of a ``ShardedOptimizer``'s memory (NOTE [offloaded step])."""

    def __init__(self, opt, swapper: Optional[Swapper], params=None, states_per_master: int = 2, grads=None):
        self.opt = opt
        self.swapper = swapper  # masters and state (None: on the device)
        self.grads = grads  # a GradOffload (NOTE [offloaded gradients] in grads.py), or None
        self.params = params  # a ParamOffload (NOTE [offloaded parameters] in params.py), or None
        self._resident = 0  # depth of resident() contexts
        self.step_seconds = 0.0  # wall time of the optimizer's arithmetic in offloaded steps (no transfers)
        if swapper is not None and swapper.disk is not None:  # a full disk fails here, before any step
            swapper.disk.need(self.nbytes(states_per_master), "offload.optimizer=disk (optimizer state and masters)")
        from meshlm.runtime.offload.host_step import HostStep

        self.host = HostStep(opt, swapper) if HostStep.applies(opt, swapper) else None  # NOTE [host step]

    def nbytes(self, states_per_master: int = 2) -> int:
        """This rank's bytes of what moves: each master that is a tensor of its own, and
        ``states_per_master`` state tensors of its size (AdamW's exp_avg and exp_avg_sq),
        made or not yet."""
        total = 0
        for p, m in self.pairs():
            local = local_data(m)
            own = m is not p and not _shares(local, local_data(p))
            total += local.numel() * local.element_size() * (states_per_master + own)
        return total

    def tensors(self, pms: Iterable) -> list[Tensor]:
        """The plain tensors that hold the memory of these (param, master) pairs' masters and
        optimizer state (the step counters, 0-dim, stay)."""
        out = []
        state = self.opt.inner.state
        for p, m in pms:
            if m is not p and not _shares(local_data(m), local_data(p)):  # a view of p holds no memory
                out.append(local_data(m))
            for v in state.get(m, {}).values():
                if torch.is_tensor(v) and v.ndim > 0:
                    out.append(local_data(v))
        return out

    def swap_in(self, pms, state: bool = True) -> None:
        if self.swapper is not None and state:
            for t in self.tensors(pms):
                self.swapper.swap_in(t)
        if self.params is not None:
            for t in self.params.tensors(p for p, _m in pms):
                self.params.swapper.swap_in(t)
        if self.grads is not None:
            for t in self._grads(pms):
                self.grads.bring_in(t)

    def _grads(self, pms) -> list[Tensor]:
        return [local_data(m.grad) for _p, m in pms if m.grad is not None]

    def swap_out(self, pms, state: bool = True) -> None:
        if self._resident:
            return
        if self.swapper is not None and state:
            for t in self.tensors(pms):
                self.swapper.swap_out(t)
        if self.params is not None:  # the step has written them: written out again
            for t in self.params.tensors(p for p, _m in pms):
                self.params.swapper.swap_out(t)
        if self.grads is not None:  # read, not written (NOTE [offloaded gradients])
            for t in self._grads(pms):
                self.grads.send_out(t)

    def pairs(self) -> list:
        return [(p, m) for _f, p, m in self.opt._pairs]

    @contextlib.contextmanager
    def resident(self):
        """Everything swapped in (a checkpoint save or load reads or writes it all), and out
        again afterwards, including state created meanwhile."""
        self.swap_in(self.pairs())
        self._resident += 1
        try:
            yield
        finally:
            self._resident -= 1
            self.swap_out(self.pairs())

    def step(self) -> dict:
        """Step chunk by chunk; returns ``{id(master): new value in the parameter's dtype}``
        for the masters that are tensors of their own (read while they are swapped in)."""
        opt = self.opt
        chunks: dict = {}
        for (_f, p, m), key in zip(opt._pairs, opt._keys):
            chunks.setdefault(key, []).append((p, m))
        fresh = {}
        for pms in chunks.values():
            if self.host is not None:  # on the host, where the state is (NOTE [host step])
                self.swap_in(pms, state=False)
                sw = self.swapper
                t0, moving = time.perf_counter(), sw.seconds_in + sw.seconds_out
                fresh.update(self.host.step(pms))  # its copies are the swapper's transfer time
                self.step_seconds += time.perf_counter() - t0 - (sw.seconds_in + sw.seconds_out - moving)
                self.swap_out(pms, state=False)
                continue
            self.swap_in(pms)
            t0 = time.perf_counter()
            with _only(opt.inner, {id(m) for _p, m in pms}):
                if opt._local_step:
                    opt._step_local()
                else:
                    opt.inner.step()
            with torch.no_grad():
                for p, m in pms:
                    if m is not p:
                        fresh[id(m)] = m.detach().to(p.dtype, copy=True)
            self.step_seconds += time.perf_counter() - t0
            self.swap_out(pms)
        return fresh


def _shares(a: Tensor, b: Tensor) -> bool:
    return compat.storage_key(a.untyped_storage()) == compat.storage_key(b.untyped_storage())


@contextlib.contextmanager
def _only(inner: torch.optim.Optimizer, ids: set):
    """The optimizer's param groups narrowed to the parameters in ``ids``."""
    saved = [g["params"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["params"] = [q for q in g["params"] if id(q) in ids]
    try:
        yield
    finally:
        for g, ps in zip(inner.param_groups, saved):
            g["params"] = ps
