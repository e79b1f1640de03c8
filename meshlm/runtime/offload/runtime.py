"""A run's offload tiers, made once per rank by ``meshlm train`` (NOTE [offload tiers] in
meshlm/runtime/offload/__init__.py): the swap directory, the optimizer's swapper, the activation
hooks, the disk-space check, and what moved (for metrics and the run summary)."""

from __future__ import annotations

import ctypes
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from meshlm.core.errors import ConfigError
from meshlm.layout.offload import OffloadSpec
from meshlm.runtime.offload.activations import ActivationOffload
from meshlm.runtime.offload.store import SwapDir, Swapper


def shared_run_id() -> str:
    """A new id, the same on every rank (rank 0's, broadcast): the swap directory's name."""
    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


#: glibc's mallopt parameter M_MMAP_THRESHOLD, and the size from which meshlm asks for it
M_MMAP_THRESHOLD, MMAP_FROM = -3, 1 << 20


def return_freed_memory() -> bool:
    """Make glibc serve allocations of 1 MiB and more with their own memory mappings, so
    that the memory of a storage swapped out to disk goes back to the operating system when
    it is freed.  By default glibc raises that threshold as large blocks are freed, and then
    keeps them in its heap: the process's resident set would not shrink by what the disk
    tier holds (measured: benchmarks/offload_memory.py, docs/offload.md).  True if set (on
    glibc; elsewhere nothing happens)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_FROM))
    except (OSError, AttributeError):
        return False


class Offload:
    """The tiers of one rank.  ``optimizer``: the ``Swapper`` to hand to ``ShardedOptimizer``
    (None: on the device); ``wrap(passes)``: the step's forward and backward under the
    activation hooks.  ``close()`` removes this rank's swap files (also at interpreter exit)."""

    def __init__(self, spec: OffloadSpec, run_dir: "str | Path", rank: int = 0, run_id: Optional[str] = None):
        self.spec = spec
        self.disk: Optional[SwapDir] = None
        if spec.uses_disk:
            base = Path(spec.dir) if spec.dir else Path(run_dir) / "offload"
            if spec.dir and not base.is_dir():  # a typo must not put the swap files somewhere new
                what = "is not a directory" if base.exists() else "does not exist"
                raise ConfigError(
                    f"offload.dir={spec.dir!r} {what}; create it (on a disk with room for this run's offloaded "
                    "state), or leave offload.dir=null for <run dir>/offload"
                )
            self.disk = SwapDir(base, rank, run_id=run_id or shared_run_id())
            return_freed_memory()
        self.optimizer = Swapper(spec.optimizer, self.disk) if spec.optimizer != "device" else None
        self.grads = Swapper(spec.grads, self.disk) if spec.grads != "device" else None
        self.params = None  # a ParamOffload, once attach() has met the model
        self.param_swapper = Swapper(spec.params, self.disk) if spec.params != "device" else None
        self.activations = ActivationOffload(spec.activations, self.disk) if spec.activations != "device" else None

    def trim(self) -> None:
        """Give the heap's free memory back to the system (glibc's ``malloc_trim``): the
        storages swapped out before ``return_freed_memory`` took effect were in the heap."""
        if self.disk is not None:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass

    def attach(self, model) -> Any:
        """Put ``model``'s block parameters on the params tier (after the blocks are
        compiled: NOTE [offloaded parameters]); returns the ParamOffload for
        ``ShardedOptimizer(offload_params=...)``, or None without it."""
        if self.spec.params != "device":
            from meshlm.runtime.offload.params import ParamOffload

            self.params = ParamOffload(model, self.param_swapper)
        return self.params

    def spill(self, block) -> None:
        """``meshlm.shard(after_block=...)`` with parameters offloaded: ``block``'s parameters
        go to their tier as soon as they are made, so the model is never whole in memory
        (NOTE [offloaded parameters]); ``attach`` then finds them there."""
        from meshlm.runtime.memory import local_data
        from meshlm.runtime.offload.store import owns_storage

        for p in block.parameters():
            t = local_data(p)
            if owns_storage(t):
                self.param_swapper.swap_out(t)

    @property
    def spills(self) -> bool:
        """Whether the model should be built with ``spill`` (parameters offloaded)."""
        return self.param_swapper is not None

    def wrap(self, passes: Callable) -> Callable:
        """``passes`` run under the activation tier's saved-tensor hooks (unchanged without)."""
        act = self.activations
        if act is None:
            return passes

        def offloaded(*args, **kwargs):
            with act.context():
                return passes(*args, **kwargs)

        return offloaded

    def stats(self, opt: Any = None) -> dict[str, float]:
        """This rank's figures so far: bytes moved to and from the tiers, bytes on disk now,
        and the offloaded steps' seconds: moving state (``transfer_s``) and the optimizer's
        arithmetic (``step_s``, from ``opt``, a ShardedOptimizer)."""
        out: dict[str, float] = {}
        if self.optimizer is not None:
            out["offload_optimizer_out_bytes"] = self.optimizer.bytes_out
            out["offload_optimizer_in_bytes"] = self.optimizer.bytes_in
            out["offload_optimizer_transfer_s"] = self.optimizer.seconds_in + self.optimizer.seconds_out
            if opt is not None and opt.offload is not None:
                out["offload_optimizer_step_s"] = opt.offload.step_seconds
        if self.grads is not None:
            out["offload_grads_out_bytes"] = self.grads.bytes_out
            out["offload_grads_in_bytes"] = self.grads.bytes_in
            out["offload_grads_transfer_s"] = self.grads.seconds_in + self.grads.seconds_out
        if self.params is not None:
            out["offload_params_in_bytes"] = self.params.swapper.bytes_in
            out["offload_params_prefetched_blocks"] = self.params.prefetched
        if self.activations is not None:
            out["offload_activations_bytes"] = self.activations.moved_bytes
        if self.disk is not None:
            out["offload_disk_bytes"] = self.disk.disk_bytes()
        return out

    def close(self) -> None:
        if self.params is not None:
            self.params.close()
        if self.disk is not None:
            self.disk.close()


def open_offload(spec: OffloadSpec, layout, pp: int, run_dir: "str | Path", rank: int) -> Optional[Offload]:
    """A run's offload tiers for this rank (``spec``: the resolved offload section, ``layout``:
    a meshlm Layout, ``pp``: the mesh's pipeline degree), checked; None when every kind of
    state stays on the device."""
    from meshlm.layout.rules import is_pipelined

    if not spec.active:
        return None
    if spec.params != "device" and is_pipelined(layout) and pp > 1:
        raise ConfigError(
            f"offload.params={spec.params} with the pipeline layout {layout.name} (pp={pp}): a stage keeps "
            "each parameter's gradient unreduced through the micro-batches and steps a copy of the parameter "
            "(NOTE [pipelined step]), which offloaded parameters cannot be refreshed from; offload the optimizer "
            "state, gradients or activations instead (offload.optimizer, offload.grads, offload.activations), "
            "or use a layout without pp"
        )
    return Offload(spec, run_dir, rank)


def adamw_impl(t, offload: Optional[Offload], device) -> dict[str, bool]:
    """torch.optim.AdamW's implementation keywords for ``train.optimizer_impl`` (``t``: the
    TrainConfig); auto: fused where the offloaded step runs on the CPU (the offloaded
    state's arithmetic is then the step's cost: benchmarks/offload_memory.py): on a CPU-only
    machine, and on the host tier, which steps on the host (NOTE [host step]); else torch's
    default."""
    impl = t.optimizer_impl
    if impl == "auto":
        opt = offload.optimizer if offload is not None else None
        impl = "fused" if opt is not None and (device.type == "cpu" or opt.tier == "host") else ""
    return {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}.get(impl, {})
