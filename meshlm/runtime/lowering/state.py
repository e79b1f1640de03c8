"""The per-model state of a sharded model: ``ShardState``, the one object ``shard`` attaches
to the root module (``model._meshlm_state``).  Everything a sharded model needs at run time
that is not a parameter lives here and dies with the model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshlm.core import annotate, rng
from meshlm.core.axes import Axes
from meshlm.core.errors import MeshlmError
from meshlm.layout.mesh import mesh_spec
from meshlm.layout.rules import INPUT_MESH_AXES, DimPlan, Layout, resolve
from meshlm.runtime.bucket import Prefetch
from meshlm.runtime.in_flight import InFlight
from meshlm.runtime.lowering.params import ParamPlan, placements


@dataclass
class ShardState:
    """What ``shard`` attaches to the root module (``model._meshlm_state``)."""

    layout: Layout
    mesh: DeviceMesh
    plans: dict[str, ParamPlan]
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    grad_dtype: Optional[torch.dtype] = None  # NOTE [main grads] in main_grad.py
    # Plain copies of the mesh's names and sizes: traced code must not read attributes off
    # the DeviceMesh (an opaque object to torch.compile).
    sizes: dict[str, int] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    overlap: bool = False  # NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py
    root: Optional[object] = (
        None  # local_root.RootSpec (NOTE [local root] in meshlm/runtime/lowering/local_root.py); None: under DTensor
    )
    coord: tuple[int, ...] = ()  # this rank's coordinate on the mesh
    handler: rng.Handler | None = None  # what annotate calls under the DTensor root: constrain, dropout
    vocab: frozenset = frozenset()  # the model's logical axes (NOTE [open vocabulary] in axes.py)
    # the blocks' order and gathers in flight (NOTE [prefetch] in meshlm/runtime/bucket/prefetch.py)
    prefetch: Prefetch = field(default_factory=Prefetch)
    # gradient reductions left in flight in the backward pass running now (NOTE [overlapped reduction])
    in_flight: InFlight = field(default_factory=InFlight)
    # root forwards run on local tensors / under DTensor (NOTE [local root] in meshlm/runtime/lowering/local_root.py)
    roots: dict[str, int] = field(default_factory=lambda: {"local": 0, "dtensor": 0})
    local_now: bool = False  # the root forward running now runs on local tensors (a pipeline stage reads it)
    # parameters gathered in this pipeline step, kept for its next micro-batches (NOTE
    # [gathered once per step] in meshlm/runtime/pipeline/pipe.py); None: gather at every use
    gathered: Optional[dict] = None
    has_buffers: bool = False  # the model has buffers (NOTE [buffers] in lowering/buffers.py)
    local_block_modules: set = field(default_factory=set)  # ids of the modules of blocks run on local tensors
    # this model's cp settings (dtensor_cp.CpMesh; NOTE [cp settings per model] in meshlm/runtime/cp/active.py)
    cp: Optional[object] = None

    def __post_init__(self) -> None:
        self.sizes = mesh_spec(self.mesh).as_dict()
        self.names = tuple(self.mesh.mesh_dim_names or ())
        self.coord = tuple(self.mesh.get_coordinate() or (0,) * len(self.names))
        self.handler = rng.Handler(
            self.constrain, self.coord, tuple(self.sizes[n] for n in self.names), balanced=self.balanced_cp
        )

    @property
    def cp_dim(self) -> Optional[int]:
        """The index of the ``cp`` mesh axis if it has more than one rank, else None."""
        return self.names.index("cp") if self.sizes.get("cp", 1) > 1 else None

    @property
    def balanced_cp(self) -> Optional[int]:
        """The cp axis's index if its splits are balanced chunks (NOTE [balanced chunks] in
        meshlm/_torch_compat/dtensor_cp.py), else None."""
        ctx = self.layout.context
        return self.cp_dim if ctx is not None and ctx.balance else None

    def placements(self, plan: DimPlan) -> tuple[Placement, ...]:
        return placements(plan, self.names)

    def activation_placements(
        self, axes: Axes, shape: Sequence[int], layout: Optional[Layout] = None
    ) -> tuple[Placement, ...]:
        """Placements of an activation under ``layout``'s compute rules (default: the top
        level's; a scope's inside it, NOTE [scoped layouts] in meshlm/core/scopes.py)."""
        layout = layout or self.layout
        plan = resolve(
            tuple(axes),
            layout.compute,
            self.sizes,
            shape=tuple(shape),
            what=f"activation {tuple(axes)} of shape {tuple(shape)}",
            layout=layout,
            known=self.vocab,
        )
        return placements(plan, self.names)

    def scope_handler(self, layout: Layout) -> rng.Handler:
        """The constraint handler inside a scope whose rules are ``layout``."""
        return rng.Handler(
            functools.partial(self.constrain, layout=layout), self.coord, self.handler.sizes, balanced=self.balanced_cp
        )

    def input_placements(self, axes: Axes) -> tuple[Placement, ...]:
        """Placements of an input given as each rank's local slice (any local size works:
        the global size is the local one times the mesh axes splitting it)."""
        plan = resolve(
            tuple(axes),
            self.layout.compute,
            self.sizes,
            what=f"input {tuple(axes)}",
            layout=self.layout,
            allow_mesh=INPUT_MESH_AXES,
            known=self.vocab,
        )
        return placements(plan, self.names)

    def constrain(self, x: Tensor, axes: Axes, layout: Optional[Layout] = None) -> Tensor:
        if not isinstance(x, DTensor):
            return x
        annotate.check_axes_count(x, axes)
        pl = self.activation_placements(axes, x.shape, layout)
        if self.cp_dim is not None:
            pl = keep_sequence_split(x.placements, pl, self.cp_dim)
        # Always through redistribute, even when the placements already agree: its backward
        # puts the gradient at the same placements, so a Partial gradient is reduced here
        # (Megatron's "f" operator at the input of a tensor-parallel block) rather than
        # carried through the residual stream and reduced later per weight.
        return x.redistribute(x.device_mesh, pl)


def keep_sequence_split(have, want, i: int) -> tuple:
    """NOTE [sequence stays split]: a ``constrain`` that leaves a dim whole keeps the
    sequence split over ``cp`` (mesh index ``i``) where the tensor has it.

    Under context parallel every activation holds this rank's slice of the sequence for the
    whole model; attention is the one operation that needs other ranks' positions, and it
    gets them itself (ring or all-gather attention, meshlm/_torch_compat/dtensor_cp.py).
    A model's constrain that names no logical axis for its positions (``WHOLE``, as inside
    tensor-parallel attention, where Megatron sequence parallelism is gathered) must not
    gather them over cp, or cp would hold every position again.  A constrain that maps some
    dim to ``cp`` (Ulysses-style heads over cp, say) is done as asked."""
    if isinstance(want[i], Replicate) and isinstance(have[i], Shard):
        return (*want[:i], have[i], *want[i + 1 :])
    return tuple(want)


def shard_state(model: nn.Module) -> ShardState:
    st = getattr(model, "_meshlm_state", None)
    if st is None:
        raise MeshlmError("this module was not lowered: call meshlm.shard(model, layout, mesh) first")
    return st
