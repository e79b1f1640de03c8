"""Hardware profiles for the cost model (docs/plan.md, "Cost model")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.core.errors import ConfigError
from meshlm.plan.report import GiB


@dataclass(frozen=True)
class Hardware:
    """A named hardware profile for the cost model (docs/plan.md)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    mfu: float  # fraction of peak a well-tuned step reaches
    intra_bw: float  # bytes/s per device, within a node (NVLink)
    inter_bw: float  # bytes/s per device, across nodes (InfiniBand)
    node_size: int  # devices per node
    memory: float  # bytes per device
    #: bytes/s each way between a device and host memory (offload.*=host; NOTE [planned
    #: offload] in meshlm/plan/offload.py), and to and from the node's disks per device (offload.*=disk)
    host_bw: float = 50e9
    disk_bw: float = 2e9


HARDWARE = {
    "h100_nvlink_ib": Hardware("h100_nvlink_ib", 989e12, 0.40, 450e9, 50e9, 8, 80 * GiB),
    "h200_nvlink_ib": Hardware("h200_nvlink_ib", 989e12, 0.40, 450e9, 50e9, 8, 141 * GiB),
    # the device is host memory: offload=host moves nothing
    "cpu": Hardware("cpu", 1e11, 0.5, 5e9, 1e9, 1, 24 * GiB, host_bw=float("inf"), disk_bw=1e9),
}


def hardware_profile(name: str) -> Hardware:
    if name == "auto":
        name = "h100_nvlink_ib" if torch.cuda.is_available() else "cpu"
    if name not in HARDWARE:
        raise ConfigError(
            f"plan.profile={name!r}: unknown hardware profile; choose one of {', '.join(HARDWARE)} or auto"
        )
    return HARDWARE[name]
