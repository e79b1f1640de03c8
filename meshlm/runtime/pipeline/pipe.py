"""A pipelined model on one rank: its stages' parameters sharded on the stage mesh, the
``StageModule`` of each of its stages, torch's schedule over them, and one training step
or evaluation through them.

NOTE [pipelined step]
    A layout that maps the ``layers`` axis to ``pp`` (``params: {layers: pp}``) runs the
    model as a pipeline over the mesh's ``pp`` axis.  Every rank builds the model on the
    meta device twice: a shadow probed for the cut (NOTE [pipeline cut]) and the model it
    trains, lowered by ``meshlm.shard`` on the stage mesh (the mesh without ``pp``) under
    the same layout, keeping only the parameters of its own stages (``keep``; the others
    are ``Absent``, NOTE [absent values]).  FSDP, ZeRO and tensor parallelism inside a
    stage are therefore exactly what they are without pp.

    Gradients are reduced once per step, not once per micro-batch: with more than one
    micro-batch the stage's layout keeps each rank's gradient unreduced through the
    micro-batches (``grads: local``, with the optimizer where the layout's gradients
    were), and ``ShardedOptimizer`` reduces it, once, at the step, as torchtitan defers
    FSDP's reduce-scatter to the last micro-batch.  meshlm's gathered-at-use parameters
    are not FSDP modules, so torch's schedules could not defer that themselves.

    NOTE [gathered once per step]
    Under ZeRO-3 inside a stage, a parameter gathered by a micro-batch's forward is kept
    until the end of the step and used by every later micro-batch, its forward and its
    backward (``ShardState.gathered``: the block runtime, the parameter getters and the
    local root look there first; eager code only), so a stage all-gathers its parameters
    once per step, not twice per micro-batch, and reduces their gradients once (above):
    what FSDP2 does with ``reshard_after_forward=False`` under torchtitan's pipelines.  The
    gathered parameters of the rank's stages are then held through the step.
    ``pipeline.regather=true`` gathers at every use instead (ZeRO-3's memory, 2m gathers a
    step).  The gather ops keep no saved tensors, so one gathered tensor can be
    back-propagated through by every micro-batch that used it.

    NOTE [stage gathers ahead]
    As the gathered parameters are held through the step anyway, the step issues the
    first gather of every block of the rank's stages at its start (``Prefetch.issue``,
    NOTE [prefetch] in meshlm/runtime/bucket/prefetch.py), and each block takes its own at its
    first forward: a later stage gathers while it waits for its first activation, and a
    stage's gathers are in flight together, not one per block in turn (NOTE [reductions in
    flight] in meshlm/runtime/bucket/flat.py).  Any that no block took are waited for and dropped
    at the end of the step.

    The global gradient norm adds every stage's squares over the ``pp`` group as well
    (``ShardedOptimizer.norm_groups``), so clipping, and float16's overflow check, see the
    whole model.  The step's loss, which only the last stage computes, is all-reduced over
    ``pp`` with its total weight and reference weight (NOTE [token weighting] in
    meshlm/core/weighting.py: one 24-byte all-reduce per step), so every rank reports it and
    rescales its gradients alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshlm import _torch_compat as compat
from meshlm.core import ties, weighting
from meshlm.core.annotate import outer_blocks
from meshlm.core.axes import MESH_AXES, Axes
from meshlm.core.errors import ConfigError, LayoutError, MeshlmError
from meshlm.core.rng import seed_forward
from meshlm.core.state import eager
from meshlm.layout.mesh import MeshSpec, init_distributed
from meshlm.layout.rules import Layout, is_pipelined, load_layout  # noqa: F401 (is_pipelined: meshlm.runtime.pipeline's API)
from meshlm.runtime import hooks
from meshlm.runtime.pipeline.cut import Cut, Probe, cut, probe
from meshlm.runtime.pipeline.schedule import make_schedule, schedule_spec
from meshlm.runtime.pipeline.stage import MicroBatches, StageModule, block_call, side_axes, side_order

DEFAULT_AXES: Axes = ("batch", "seq", "embed")


def check_layout(layout: Layout) -> None:
    for sec, rules in (("params", layout.params), ("compute", layout.compute)):
        other = [a for a in rules.get("layers", ()) if a != "pp"]
        if other:
            raise LayoutError(
                f"{layout.source}: {sec}.layers: {other}: the stack of blocks is split over pp only (layers: pp); "
                "shard the other axes inside a stage with the other logical axes"
            )
    for sec in ("params", "compute", "grads", "optimizer"):
        rules = layout.rules(sec)
        for key, axes in rules.items() if isinstance(rules, dict) else ():
            if key != "layers" and "pp" in axes:
                raise LayoutError(
                    f"{layout.source}: {sec}.{key}: {list(axes)}: pp splits the stack of blocks (layers: pp), not a "
                    f"tensor dim; map {key!r} to another mesh axis"
                )


def pipeline_mesh(shape: "dict[str, int] | str | MeshSpec", device_type: Optional[str] = None):
    """(the full mesh, the stage mesh without pp) for ``shape``; the stage mesh has a size-1
    ``dp`` axis where pp is the mesh's only axis of size > 1."""
    init_distributed()
    if not dist.is_initialized():
        raise ConfigError("pipeline parallelism needs a distributed launch (meshlm train, or torchrun)")
    spec = MeshSpec.parse(shape, dist.get_world_size())
    sizes = dict(spec.axes)
    if sizes.get("pp", 1) < 2:
        raise ConfigError(f"a pp layout needs mesh.pp > 1; mesh {spec} has pp={sizes.get('pp', 1)}")
    if spec.size != dist.get_world_size():
        raise ConfigError(f"mesh {spec} has {spec.size} devices but the job has {dist.get_world_size()} processes")
    stage_axes = [(a, s) for a, s in spec.axes if s > 1 and a != "pp"] or [("dp", 1)]
    names = [a for a in MESH_AXES if a == "pp" or a in dict(stage_axes)]
    dims = {**dict(stage_axes), "pp": sizes["pp"]}
    dev = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(dev, tuple(dims[a] for a in names), mesh_dim_names=tuple(names))
    sub_names = tuple(a for a in names if a != "pp")
    sub = mesh[sub_names[0]] if len(sub_names) == 1 else mesh[sub_names]
    mesh._meshlm_spec = spec
    rest = {a: s for a, s in spec.axes if a != "pp"}
    rest.update({a: s for a, s in stage_axes if a not in rest})
    sub._meshlm_spec = MeshSpec(tuple((a, rest[a]) for a in MESH_AXES if a in rest))
    return mesh, sub


def deferred(layout: Layout, microbatches: int) -> Layout:
    """The stage's layout: gradients kept local through the micro-batches and reduced once
    at the step (NOTE [pipelined step])."""
    if microbatches < 2 or layout.grads == "local":
        return layout
    return dataclasses.replace(layout, grads="local", optimizer=dict(layout.optimizer_rules))


class Pipeline:
    """This rank's part of a pipelined model (NOTE [pipelined step]): ``model`` (the
    sharded model, its own stages' parameters), ``stages`` (their StageModules),
    ``cut``, the meshes and the pp group; ``passes`` runs a step's micro-batches."""

    def __init__(
        self, model, stages, cut_: Cut, probe_: Probe, mesh, sub, spec, microbatches, axes, mbs, regather: bool = False
    ):
        self.model, self.stage_modules, self.cut, self.probe = model, stages, cut_, probe_
        self.mesh, self.sub, self.spec, self.microbatches, self.axes, self.mbs = (
            mesh,
            sub,
            spec,
            microbatches,
            axes,
            mbs,
        )
        self.group = mesh.get_group("pp")
        self.pp = mesh.size(mesh.mesh_dim_names.index("pp"))
        self.pp_rank = mesh.get_local_rank("pp")
        self.device = torch.device(mesh.device_type)
        self._schedule = None
        self._opt = None  # the ShardedOptimizer attached (attach)
        self._acc = None  # this step's weighting (NOTE [token weighting] in meshlm/core/weighting.py)
        self._scale: Optional[Callable] = None
        self.keep_gathered = microbatches > 1 and not regather  # NOTE [gathered once per step]

    @contextlib.contextmanager
    def gathering(self):
        """Within: parameters gathered once and kept (NOTE [gathered once per step]), every
        block's gather issued on entry (NOTE [stage gathers ahead])."""
        st = self.model._meshlm_state
        st.gathered = {} if self.keep_gathered else None
        if self.keep_gathered and eager():
            for pos in range(len(st.prefetch.order)):
                st.prefetch.issue(pos)
        try:
            yield
        finally:
            st.gathered = None
            st.prefetch.drain()

    def from_stages(
        self, own: dict[str, torch.Tensor], names: Sequence[Sequence[str]], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Every stage's tensors on every rank (what ``meshlm.unshard`` gathers a pipelined
        model with): ``names[s]``, the names of stage ``s``'s tensors, are broadcast over pp
        from the rank that holds stage ``s``, where ``own`` (name -> tensor) has them whole
        (their shapes, dtypes and ``requires_grad`` first).  Collective over the pp group; the
        tensors come back on ``device``."""
        out: dict[str, torch.Tensor] = {}
        for s, ns in enumerate(names):
            ns = sorted(ns)
            src = dist.get_global_rank(self.group, self.cut.ranks[s])
            mine = self.cut.ranks[s] == self.pp_rank
            meta = [[(tuple(own[n].shape), own[n].dtype, own[n].requires_grad) for n in ns] if mine else None]
            dist.broadcast_object_list(meta, src=src, group=self.group, device=self.device)
            for n, (shape, dtype, grad) in zip(ns, meta[0]):
                t = own[n].detach().to(self.device) if mine else torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(t, src=src, group=self.group)
                out[n] = t.to(device).requires_grad_(grad)
        return out

    # ------------------------------------------------------------------ shapes
    def boundary_shape(self, block: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Local shape and dtype of the hidden state entering ``block`` on this rank."""
        st = self.model._meshlm_state
        shape = self.probe.shapes[block]
        pl = st.activation_placements(self.axes, shape)
        local = list(shape)
        for i, p in enumerate(pl):
            if p.is_shard():
                local[p.dim] //= self.sub.size(i)
        return tuple(local), st.compute_dtype or self.probe.dtypes[block]

    def boundary_tensors(self, stage: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Local shape and dtype of each tensor entering ``stage`` (> 0) from the stage before:
        the hidden state, then the side outputs of the blocks before it (NOTE [side outputs]
        in meshlm/runtime/pipeline/stage.py)."""
        out = [self.boundary_shape(self.cut.stages[stage][0])]
        st = self.model._meshlm_state
        rows = self.probe.shapes[self.cut.stages[0][0]][0]
        for _fqn, shape, dt in side_order(self.cut, self.probe.sides, stage - 1):
            local = list(shape)
            for i, p in enumerate(st.activation_placements(side_axes(shape, rows), shape)):
                if p.is_shard():
                    local[p.dim] //= self.sub.size(i)
            out.append((tuple(local), dt))
        return out

    def _stages(self, first_input: torch.Tensor) -> list:
        from torch.distributed.pipelining import PipelineStage

        out, n = [], len(self.cut.stages)
        for sm in self.stage_modules:
            s = sm.stage
            if s == 0:
                inp = first_input
            else:
                inp = self._buffers(s)
            if s < n - 1:
                res = self._buffers(s + 1)
            else:
                res = torch.empty((1,), device=self.device, requires_grad=True)
            out.append(PipelineStage(sm, s, n, self.device, input_args=inp, output_args=res, group=self.group))
        return out

    def _buffers(self, stage: int):
        """Empty tensors like what enters ``stage``: one, or a tuple with side outputs."""
        ts = tuple(
            torch.empty(shape, dtype=dt, device=self.device, requires_grad=True)
            for shape, dt in self.boundary_tensors(stage)
        )
        return ts[0] if len(ts) == 1 else ts

    def _loss_fn(self, out, target):
        # NOTE [token weighting] in meshlm/core/weighting.py: micro-batch j's loss weighted by its
        # weight; a planner's fake step has no values to weigh by, and divides by their number
        if compat.fake_mode_active():
            c = 1.0 / self.microbatches
        else:
            c = self._weigh(int(target.reshape(-1)[0]))
        m = out.sum() * c
        return self._scale(m) if self._scale is not None else m

    def _weigh(self, j: int) -> float:
        """Micro-batch ``j``'s loss into this step's weighting; its coefficient."""
        w = self.mbs.weights[j]
        return self._acc.add(None if w is None else weighting.number(w), float(self.mbs.losses[j]))

    # ------------------------------------------------------------------ a step
    def begin(self, inputs: list) -> None:
        self.mbs.inputs = inputs
        self.mbs.losses = [None] * len(inputs)
        self.mbs.weights = [None] * len(inputs)
        self._acc = weighting.Accumulation(len(inputs))
        with compat.outside_fake():
            self.mbs.rng = torch.get_rng_state()
        for sm in self.stage_modules:
            sm.begin()

    def finish(self) -> float:
        """Set torch's generator past the step (NOTE [stage forward]) and return the mean
        micro-batch loss, all-reduced over pp."""
        ends = [sm.end_rng() for sm in self.stage_modules]
        if any(not torch.equal(ends[0], e) for e in ends[1:]):
            raise RuntimeError("pipeline: the stages of this rank ended the step at different generator states")
        torch.set_rng_state(ends[0])
        # the last stage's weighted sum, total weight and reference weight (NOTE [token
        # weighting]), zeros elsewhere: one all-reduce over pp gives every rank the step's loss
        # and the factor its gradients take
        acc = self._acc
        total = torch.tensor([acc.weighted, acc.total, acc.ref or 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        acc.weighted, acc.total, acc.ref = (float(v) for v in total.tolist())
        acc.ref = acc.ref or None
        weighting.rescale(acc.grad_factor(), self._opt, nn.ModuleList(self.stage_modules))
        return acc.loss()

    def attach(self, opt, early: Optional[bool] = None) -> None:
        """Connect the step's ``ShardedOptimizer``: every stage's gradients count in its norm
        (``norm_groups``); with ``early`` (default: on an accelerator, not on a CPU mesh), where
        gradients are kept local through the micro-batches, each chunk's reduction starts in
        the backward that makes its last gradient (NOTE [early reduction] in
        meshlm/runtime/optim/early.py)."""
        opt.norm_groups = [self.group]
        self._opt = opt  # whose gradients a step rescales (NOTE [token weighting])
        if early is None:
            early = self.device.type != "cpu"
        if early and self.microbatches > 1:
            opt.reduce_early(self.microbatches)

    def step(self, inputs: list, scale: Optional[Callable] = None) -> float:
        """Forward and backward of the micro-batches ``inputs`` ((args, kwargs) each, this
        rank's slice) through the schedule; the gradients are left in place.  Returns the
        mean micro-batch loss."""
        if len(inputs) != self.microbatches:
            raise ConfigError(f"pipeline: {len(inputs)} micro-batches for a schedule of {self.microbatches}")
        self.begin(inputs)
        x = torch.cat([a[0] for a, _k in inputs])
        if self._schedule is None:
            # the example of the first stage's input: a chunk of x as the schedule splits it
            # (torch 2.11 checks each micro-batch's strides against it)
            first = x.tensor_split(self.microbatches)[0]
            self._schedule = make_schedule(self.spec, self._stages(first), self.microbatches, self._loss_fn)
            # every pair of the pp group connected before the first point-to-point message
            # (torch 2.11's gloo otherwise can send before a pair is: "Pair is not connected")
            dist.barrier(group=self.group)
        self._scale = scale
        target = torch.arange(self.microbatches, device=self.device)
        with self.gathering():
            self._schedule.step(x, target=target)
        return self.finish()

    def passes(self, next_batch: Callable[[], tuple], device, scale_hook=None, seed: Optional[int] = None):
        """A ``meshlm.train.step.Passes``: ``train.grad_accum`` micro-batches from
        ``next_batch()`` ((tokens, targets)) through the pipeline.  ``seed``: each
        micro-batch's forward starts from torch's generator seeded by (seed, step,
        micro-batch), as ``meshlm.train.step.accumulate`` does (NOTE [dropout keys]); None:
        the stages chain the generator from the state the step starts at."""

        def passes(step: int, scale=None) -> float:
            inputs = []
            for _ in range(self.microbatches):
                x, y = next_batch()
                inputs.append(((x.to(device), y.to(device)), {}))
            if seed is None:
                return self.step(inputs, scale)
            starts = []
            with compat.outside_fake():
                for j in range(self.microbatches):
                    seed_forward(seed, step, j)
                    starts.append(torch.get_rng_state())
            self.mbs.starts = starts
            try:
                return self.step(inputs, scale)
            finally:
                self.mbs.starts = None

        return passes

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, inputs: Sequence) -> float:
        """The mean loss over ``inputs`` (one micro-batch each), forward only, stage after
        stage; every rank returns it."""
        n = len(self.cut.stages)
        here = {sm.stage: sm for sm in self.stage_modules}
        total = 0.0
        for args, kwargs in inputs:
            self.begin([(args, kwargs)])
            h = None
            for s in range(n):
                rank = self.cut.ranks[s]
                if s > 0 and rank != self.cut.ranks[s - 1] and rank == self.pp_rank:
                    h = tuple(
                        torch.empty(shape, dtype=dt, device=self.device) for shape, dt in self.boundary_tensors(s)
                    )
                    for t in h:
                        dist.recv(t, src=dist.get_global_rank(self.group, self.cut.ranks[s - 1]), group=self.group)
                if rank == self.pp_rank:
                    h = here[s](args[0]) if s == 0 else here[s](*h)
                    h = h if isinstance(h, tuple) else (h,)
                    if s < n - 1 and self.cut.ranks[s + 1] != rank:
                        for t in h:
                            dist.send(t, dst=dist.get_global_rank(self.group, self.cut.ranks[s + 1]), group=self.group)
            if self.mbs.losses[0] is not None:  # the last stage's rank: weighed as loss_fn weighs it
                self._weigh(0)
            total += self.finish()
        return total / len(inputs)


def _agree(c: Cut) -> None:
    """Every rank cut the model alike (a divergent cut would hang the first step); the
    planner's fake process group (one process) has nothing to compare."""
    if dist.get_backend() == "fake":
        return
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (c.stages, c.ranks))
    if any(g != got[0] for g in got):
        raise MeshlmError(f"pipeline: the ranks cut the model differently: {sorted(set(map(str, got)))}")


def build_pipeline(
    build: Callable[[str], nn.Module],
    layout: "Layout | str",
    mesh: DeviceMesh,
    sub: DeviceMesh,
    *,
    example: tuple,
    microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    split: Optional[Sequence[int]] = None,
    pick_loss: Callable[[Any], torch.Tensor] = lambda out: out,
    seed: int = 0,
    regather: bool = False,
    **shard_kw,
) -> Pipeline:
    """This rank's part of ``build``'s model as a pipeline over ``mesh``'s pp axis (NOTE
    [pipelined step]).  ``example``: (args, kwargs) of one global micro-batch (shapes only;
    the cut's probe, NOTE [pipeline cut]); ``pick_loss(output)``: the scalar loss in what
    the model returns; ``regather``: gather ZeRO-3 parameters at every use, not once per
    step (NOTE [gathered once per step])."""
    from meshlm.runtime.lowering import shard

    layout = load_layout(layout)
    check_layout(layout)
    pp = mesh.size(mesh.mesh_dim_names.index("pp"))
    spec = schedule_spec(schedule, stages_per_rank, pp, microbatches)
    with compat.outside_fake():  # shapes on meta, outside the planner's FakeTensorMode if one is active
        shadow = build("meta")
        ties.shared_across_blocks(shadow, "pipeline stages each hold the blocks they run")
        pr = probe(shadow, *example)
    c = cut(pr, pp * stages_per_rank, pp, spec.style, split)
    _agree(c)
    rank = mesh.get_local_rank("pp")
    mine = c.stages_on(rank)
    keep = set().union(*(c.params[s] for s in mine))
    model = build("meta")
    axes = tuple(getattr(model, "pipeline_axes", None) or DEFAULT_AXES)
    shard(model, deferred(layout, microbatches), sub, seed=seed, keep=keep, **shard_kw)
    names = {id(m): n for n, m in model.named_modules()}
    calls = {}
    for blk in outer_blocks(model):
        fqn = names[id(blk)]
        skip = not pr.draws[fqn] and pr.same_shape[fqn]
        calls[fqn] = (blk, block_call(fqn, blk, shadow.get_submodule(fqn), skip, not pr.tail_draws[fqn]))
        hooks.wrap_call(blk, hooks.PIPELINE, calls[fqn][1])
    mbs = MicroBatches()
    stages = [StageModule(model, s, c, calls, pr, pick_loss, axes, mbs) for s in mine]
    pipe = Pipeline(model, stages, c, pr, mesh, sub, spec, microbatches, axes, mbs, regather)
    hooks.set_attrs(model, hooks.PIPELINE, _meshlm_pipeline=pipe)  # what meshlm.unshard gathers over pp with
    return pipe
