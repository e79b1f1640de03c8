"""``check_training`` for pipeline layouts (a layout with ``layers: pp`` on a mesh with
``pp`` > 1): the sharded side is this rank's part of a ``meshlm.runtime.pipeline.Pipeline``, whose
step runs every micro-batch through torch's schedule at once (NOTE [pipelined step] in
meshlm/runtime/pipeline/pipe.py).  The checks are the same as for every layout, each rank checking
the parameters its stages hold; the losses (which only the last stage computes) and the
weights the probe steps from (which no rank holds whole) are gathered over pp first."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.recipes import forward_seed


def wants_pipeline(layout: str, mesh_shape) -> bool:
    from meshlm.layout.mesh import MeshSpec
    from meshlm.layout.rules import load_layout
    from meshlm.runtime.pipeline import is_pipelined

    return (
        is_pipelined(load_layout(layout))
        and MeshSpec.parse(mesh_shape, dist.get_world_size()).as_dict().get("pp", 1) > 1
    )


def build(job, mesh, sub, seed: int, from_seed: bool, schedule: str, stages_per_rank: int, **shard_kw):
    """This rank's Pipeline of ``job``'s model under ``job.layout``."""
    from meshlm.runtime.pipeline import build_pipeline

    if not from_seed:
        raise ValueError("check_training(from_seed=False) under a pipeline layout: stages initialise from a seed")
    args, kwargs = job.batches(1, 0)
    return build_pipeline(
        lambda device: job.build(device, seed),
        job.layout,
        mesh,
        sub,
        example=(args, kwargs),
        microbatches=job.grad_accum,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        seed=seed,
        **shard_kw,
    )


class Piped:
    """A step's micro-batches through the pipeline (``check_training``'s runner)."""

    def __init__(self, pipe):
        self.pipe = pipe

    def setup(self, opt) -> None:
        self.pipe.attach(opt)

    def passes(self, job, model: nn.Module, micro: list, seed: int, step: int) -> list[Tensor]:
        inputs = [job._shard(args, kwargs) for args, kwargs in micro]
        starts = []
        for j in range(len(micro)):  # the reference reseeds before each micro-batch's forward
            torch.manual_seed(forward_seed(seed, step, j))
            starts.append(torch.get_rng_state())
        self.pipe.mbs.starts = starts
        self.pipe.step([(tuple(a), kw) for a, kw in inputs])
        job._check_placed(model)
        got: list = [None] * self.pipe.pp
        mine = [None if x is None else float(x) for x in self.pipe.mbs.losses]
        dist.all_gather_object(got, mine, group=self.pipe.group)
        losses = [next(x[j] for x in got if x[j] is not None) for j in range(len(micro))]
        return [torch.tensor(x, dtype=torch.float64) for x in losses]

    def everywhere(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        got: list = [None] * self.pipe.pp
        dist.all_gather_object(got, weights, group=self.pipe.group)
        return {k: v for part in got for k, v in part.items()}
