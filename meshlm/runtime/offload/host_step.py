"""The optimizer step on the host, where ``offload.optimizer=host`` keeps the state.

NOTE [host step]
    With the optimizer state on the ``host`` tier and the parameters on an accelerator, the
    step runs on the CPU, where the state lives, as ZeRO-Offload's CPU Adam does: the state
    never comes to the device.  ``OptimizerOffload.step`` hands each chunk (NOTE [optimizer
    chunks] in meshlm/runtime/optim/chunks.py) to ``HostStep.step``, which

    - copies the chunk's gradients to host buffers (device to host: the gradients' bytes);
    - steps host masters with the torch optimizer on the host tensors: a master that is a
      tensor of its own (float32 masters of bf16 storage, ZeRO-1/2 copies) is out on the
      host tier already and its host copy is stepped in place; a master that is the
      parameter itself, or a view of it, gets a host copy, made at the first step and made
      again whenever the parameter was changed by anything but this step (a version counter
      of the parameter, the master or its local tensor moved: a checkpoint load);
    - hands the optimizer the state's host copies (the step counters, 0-dim, as CPU
      tensors), and state the first step makes on the host becomes the host copy of a device
      tensor whose storage is freed (``Swapper.adopt``), so checkpoints and
      ``ShardedOptimizer.resident()`` see the state as they see any swapped state;
    - copies the new values to the device (host to device: the parameters' bytes, in their
      dtype): into the parameter, or as the fresh value of a master of its own.

    Per step that moves the gradients down and the parameters up, where stepping on the
    device moves the state and masters both ways (AdamW with float32 masters of bf16
    storage: 4 + 2 bytes a parameter instead of 2 x 12).  The host holds the state, a master
    and a gradient buffer per parameter.  The arithmetic is the torch optimizer's on the same
    values, so the weights equal the run without offload bit for bit; ``train.optimizer_impl=
    auto`` picks torch's fused AdamW, whose CPU kernel steps the host tensors.

    Only elementwise optimizers step on the host (NOTE [local step] in meshlm/runtime/optim/sharded.py); a
    whole-tensor one brings its state to the device as the disk tier does.  On a machine
    without an accelerator the device is host memory and ``host`` moves nothing, so none of
    this runs; ``Swapper(simulate=True)`` runs it there (tests/dist/test_offload_host.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.runtime.memory import local_data
from meshlm.runtime.offload.store import Swapper, host_empty


class HostStep:
    """The host step of a ``ShardedOptimizer`` whose state is on the host tier."""

    def __init__(self, opt, swapper: Swapper):
        self.opt, self.swapper = opt, swapper
        self.masters: dict[int, tuple[Tensor, tuple]] = {}  # id(device master) -> (host copy, _stamp then)
        self.grads: dict[int, Tensor] = {}  # id(device master) -> host gradient buffer

    @staticmethod
    def applies(opt, swapper: "Swapper | None") -> bool:
        """Whether ``opt`` steps on the host: its state is on the host tier, the parameters are
        where that tier moves things from, and the optimizer is elementwise."""
        if not isinstance(swapper, Swapper) or swapper.tier != "host" or not opt._local_step:
            return False  # (the planner's fake tiers count what the host step moves by formula: planned)
        return any(swapper.moves(local_data(p)) for _f, p, _m in opt._pairs)

    def _count(self, nbytes: int, t0: float, down: bool) -> None:
        sw = self.swapper
        if down:
            sw.bytes_out += nbytes
            sw.seconds_out += time.perf_counter() - t0
        else:
            sw.bytes_in += nbytes
            sw.seconds_in += time.perf_counter() - t0

    @staticmethod
    def _stamp(p: Tensor, m: Tensor, loc: Tensor) -> tuple:
        """The version counters that a write to the parameter or its master moves: an in-place
        op on a DTensor moves the wrapper's, not its local tensor's."""
        return tuple(compat.version_counter(t) for t in (p, m, loc))

    def _master(self, p: Tensor, m: Tensor, loc: Tensor) -> Tensor:
        h = self.swapper.host_of(loc)
        if h is not None:  # a master of its own, out on the host: its host copy is the master
            return h
        h, stamp = self.masters.get(id(loc), (None, None))
        if h is None or stamp != self._stamp(p, m, loc):
            t0 = time.perf_counter()
            h = host_empty(loc.shape, loc.dtype) if h is None else h
            with torch.no_grad():
                h.copy_(loc)
            self.masters[id(loc)] = (h, self._stamp(p, m, loc))
            self._count(loc.numel() * loc.element_size(), t0, down=True)
        return h

    def _grad(self, m: nn.Parameter, loc: Tensor) -> "Tensor | None":
        g = local_data(m.grad)
        if g is None:
            return None
        t0 = time.perf_counter()
        buf = self.grads.get(id(loc))
        if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
            buf = self.grads[id(loc)] = host_empty(g.shape, g.dtype)
        buf.copy_(g)
        self._count(g.numel() * g.element_size(), t0, down=True)
        return buf

    def _host_state(self, st: dict) -> dict:
        out = {}
        for k, v in st.items():
            lv = local_data(v)
            if torch.is_tensor(lv) and lv.ndim > 0:
                h = self.swapper.host_of(lv)
                out[k] = lv if h is None else h
            elif torch.is_tensor(lv):  # the step counter
                out[k] = lv if lv.device.type == "cpu" else lv.cpu()
            else:
                out[k] = lv
        return out

    def _device_state(self, m: nn.Parameter, loc: Tensor, old: "dict | None", new: dict) -> dict:
        if old is not None:  # the device-side tensors stay; the step counters take the new counts
            for k, v in old.items():
                lv = local_data(v)
                if torch.is_tensor(lv) and lv.ndim == 0 and new[k] is not lv:
                    lv.copy_(new[k])
            return old
        made = {}  # the first step: the state was made on the host
        for k, hv in new.items():
            if torch.is_tensor(hv) and hv.ndim > 0:
                d = self.opt._like(torch.empty(hv.shape, dtype=hv.dtype, device=loc.device), m, k)
                self.swapper.adopt(local_data(d), hv)  # the tensor the swapper knows: the DTensor's local
                made[k] = d
            elif torch.is_tensor(hv):
                made[k] = self.opt._like(hv.to(loc.device), m, k)
            else:
                made[k] = hv
        return made

    def step(self, pms: list) -> dict:
        """Step the chunk ``pms`` ((parameter, master) pairs) on the host; returns ``{id(master):
        new value in the parameter's dtype, on the device}`` for the masters of their own."""
        inner = self.opt.inner
        pairs = {id(m): p for p, m in pms}
        saved = [g["params"] for g in inner.param_groups]
        made, old = [], {}
        with torch.no_grad():
            for group in inner.param_groups:
                chunk = []
                for m in group["params"]:
                    if id(m) not in pairs:
                        continue
                    loc = local_data(m)  # the object the swapper keys a master of its own by
                    h = self._master(pairs[id(m)], m, loc)
                    lp = nn.Parameter(h, requires_grad=m.requires_grad)
                    lp.grad = self._grad(m, loc)
                    st = inner.state.pop(m, None)
                    if st:
                        old[id(m)] = st
                        inner.state[lp] = self._host_state(st)
                    chunk.append(lp)
                    made.append((lp, m, loc, h))
                group["params"] = chunk
        try:
            inner.step()
        finally:
            for group, masters in zip(inner.param_groups, saved):
                group["params"] = masters
            for lp, *_rest in made:
                lp.grad = None
        fresh = {}
        with torch.no_grad():
            for lp, m, loc, h in made:
                new = inner.state.pop(lp, None)
                if new:
                    inner.state[m] = self._device_state(m, loc, old.get(id(m)), new)
                elif id(m) in old:
                    inner.state[m] = old[id(m)]
                t0 = time.perf_counter()
                p = pairs[id(m)]
                if self.swapper.host_of(loc) is h:  # a master of its own: its new value goes up
                    x = h.to(device=loc.device, dtype=p.dtype, copy=True)
                    fresh[id(m)] = (
                        DTensor.from_local(
                            x, m.device_mesh, m.placements, run_check=False, shape=m.shape, stride=m.stride()
                        )
                        if isinstance(m, DTensor)
                        else x
                    )
                    nbytes = x.numel() * x.element_size()
                else:  # the parameter itself, or a view of it
                    loc.copy_(h)
                    self.masters[id(loc)] = (h, self._stamp(p, m, loc))
                    nbytes = loc.numel() * loc.element_size()
                self._count(nbytes, t0, down=False)
        return fresh


def planned(opt) -> tuple[int, int, int]:
    """This rank's figures of ``opt``'s host step (NOTE [host step]), from its parameters and
    masters: the host bytes beyond ``OptimizerOffload.nbytes`` (host copies of the masters
    that are no tensors of their own, and a gradient buffer per master), the bytes a step
    moves up (each master's new value, in its parameter's dtype) and down (its gradient)."""
    extra = up = down = 0
    for _f, p, m in opt._pairs:
        loc, ploc = local_data(m), local_data(p)
        n, size = loc.numel(), loc.element_size()
        own = m is not p and compat.storage_key(loc.untyped_storage()) != compat.storage_key(ploc.untyped_storage())
        extra += n * size * (1 if own else 2)
        up += n * ploc.element_size()
        down += n * size
    return extra, up, down
