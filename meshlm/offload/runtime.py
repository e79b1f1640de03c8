"""A run's offload tiers, made once per rank by ``meshlm train`` (NOTE [offload tiers] in
meshlm/offload/__init__.py): the swap directory, the optimizer's swapper, the activation
hooks, the disk-space check, and what moved (for metrics and the run summary)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from meshlm.errors import ConfigError
from meshlm.offload.activations import ActivationOffload
from meshlm.offload.spec import OffloadSpec
from meshlm.offload.store import SwapDir, Swapper


def shared_run_id() -> str:
    """A new id, the same on every rank (rank 0's, broadcast): the swap directory's name."""
    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


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
        self.optimizer = Swapper(spec.optimizer, self.disk) if spec.optimizer != "device" else None
        self.activations = ActivationOffload(spec.activations, self.disk) if spec.activations != "device" else None

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
        if self.activations is not None:
            out["offload_activations_bytes"] = self.activations.moved_bytes
        if self.disk is not None:
            out["offload_disk_bytes"] = self.disk.disk_bytes()
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
