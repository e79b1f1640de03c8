"""Named device meshes: MeshSpec (ordered axis -> size) and the DeviceMesh built from it.

``make_mesh({"fsdp": 2, "tp": 2})`` works three ways:

* under torchrun (or any launcher that set RANK/WORLD_SIZE): joins that process group,
  gloo on CPU, nccl on CUDA;
* already inside an initialised process group: uses it;
* ``fake=True``: a fake process group in this one process, for any world size (shapes,
  placements, memory and collective accounting only; no numerics).
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshlm.core.axes import MESH_AXES, check_mesh
from meshlm.core.errors import MeshError


@dataclass(frozen=True)
class MeshSpec:
    """Mesh axes and their sizes, in canonical outer -> inner order (see ``MESH_AXES``)."""

    axes: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, shape: "Mapping[str, int] | str | MeshSpec", world_size: int | None = None) -> "MeshSpec":
        """Build from ``{"fsdp": 2, "tp": 2}`` or ``"fsdp=2,tp=2"``; one size may be -1
        (the rest of ``world_size``).  Axes are reordered to canonical order."""
        if isinstance(shape, MeshSpec):
            return shape
        if isinstance(shape, str):
            items = {}
            for part in filter(None, (p.strip() for p in shape.split(","))):
                if "=" not in part:
                    raise MeshError(f"mesh {shape!r}: expected axis=size pairs like 'fsdp=2,tp=2', got {part!r}")
                k, v = part.split("=", 1)
                try:
                    items[k.strip()] = int(v)
                except ValueError:
                    raise MeshError(
                        f"mesh {shape!r}: size of axis {k.strip()!r} must be an integer, got {v!r}"
                    ) from None
            shape = items
        sizes = dict(shape)
        for name, size in sizes.items():
            check_mesh(name, "mesh")
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise MeshError(
                    f"mesh axis {name!r} has size {size!r}: sizes are positive integers, or -1 for 'the rest'"
                )
        wild = [k for k, v in sizes.items() if v == -1]
        if len(wild) > 1:
            raise MeshError(f"mesh {sizes}: at most one axis may be -1, got {wild}")
        if wild:
            if world_size is None:
                raise MeshError(f"mesh {sizes}: axis {wild[0]!r} is -1 but the world size is unknown")
            known = math.prod(v for v in sizes.values() if v != -1)
            if world_size % known:
                raise MeshError(
                    f"mesh {sizes}: the other axes multiply to {known}, which does not divide the world size "
                    f"{world_size}, so {wild[0]!r}=-1 has no integer size"
                )
            sizes[wild[0]] = world_size // known
        return cls(tuple((a, sizes[a]) for a in MESH_AXES if a in sizes))

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def as_dict(self) -> dict[str, int]:
        return dict(self.axes)

    def active(self) -> tuple[tuple[str, int], ...]:
        """Axes of size > 1 (size-1 axes drop out of every layout); at least one axis."""
        act = tuple((a, s) for a, s in self.axes if s > 1)
        return act or (self.axes[:1] if self.axes else (("dp", 1),))

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes) or "single"


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment if not done yet."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("MESHLM_PG_TIMEOUT", 600)))
    dist.init_process_group(backend, timeout=timeout)


def init_fake(world_size: int, rank: int = 0) -> None:
    """A fake process group of ``world_size`` ranks in this one process (this process is
    ``rank``).  Collectives do nothing; use it for shapes and accounting only."""
    from meshlm import _torch_compat as compat

    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    # DTensor's caches compare meshes by value, so specs cached under an earlier process
    # group would hand this one's DTensors meshes whose groups are gone.
    compat.clear_dtensor_caches()
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world_size)


def make_mesh(
    shape: "Mapping[str, int] | str | MeshSpec", *, fake: bool = False, device_type: str | None = None
) -> DeviceMesh:
    """A named DeviceMesh over the given mesh axes (canonical order ``dp, fsdp, tp, cp, pp, ep``).

    Size-1 axes are accepted and left out of the DeviceMesh.  Without a process group and
    outside torchrun, a mesh of size 1 runs in this process alone.
    """
    if fake:
        spec = MeshSpec.parse(shape, None)
        if any(s == -1 for _, s in spec.axes):
            raise MeshError("a fake mesh needs explicit sizes (no -1)")
        init_fake(spec.size)
    else:
        init_distributed()
        if not dist.is_initialized():
            spec = MeshSpec.parse(shape, 1)
            if spec.size != 1:
                raise MeshError(
                    f"mesh {spec} needs {spec.size} processes but this is a single process outside a "
                    f"distributed launch. Run under `torchrun --nproc-per-node {spec.size}` (or `meshlm train`, "
                    "which launches its own workers), or pass fake=True for shapes and accounting only."
                )
            # an in-process store: a port picked free and bound later can be taken meanwhile
            # by another process (EADDRINUSE), and one process needs no rendezvous
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = MeshSpec.parse(shape, dist.get_world_size())
    if spec.size != dist.get_world_size():
        raise MeshError(
            f"mesh {spec} has {spec.size} devices but the job has {dist.get_world_size()} processes. "
            "Make the mesh sizes multiply to the number of processes (one axis may be -1 for 'the rest')."
        )
    active = spec.active()
    dev = device_type or ("cpu" if fake or dist.get_backend() == "gloo" else _device_type())
    mesh = init_device_mesh(dev, tuple(s for _, s in active), mesh_dim_names=tuple(a for a, _ in active))
    mesh._meshlm_spec = spec  # the full spec, size-1 axes included (for reports)
    from meshlm._torch_compat import dtensor_scope

    dtensor_scope.claim(mesh)  # its DTensors get meshlm's DTensor rules (NOTE [scoped patches])
    return mesh


def mesh_spec(mesh: DeviceMesh) -> MeshSpec:
    """The MeshSpec a mesh was built from (or one read off its names and sizes)."""
    spec = getattr(mesh, "_meshlm_spec", None)
    if spec is None:
        spec = MeshSpec(tuple(zip(mesh.mesh_dim_names or (), mesh.mesh.shape)))
    return spec
