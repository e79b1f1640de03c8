"""One pipeline stage's forward: the model's own forward, its stage's blocks run for real,
everything else on ``Absent`` tensors.

NOTE [stage forward]
    A ``StageModule`` is what torch's ``PipelineStage`` runs.  Its forward calls the
    sharded model's own forward on the micro-batch's inputs (every rank of a stage holds
    them: pp ranks read the same examples) with a ``StageRun`` in effect, and every outer
    block of the model is called through ``block_call`` (``hooks.wrap_call``: outside any
    compiled region):

    - a block of this stage runs for real; on stages after the first, the stage's first
      block takes the tensor received from the previous stage as its first argument, in
      place of the ``Absent`` the forward computed there (NOTE [absent values]);
    - where the forward reaches the next stage's first block, that block's first argument
      is what this stage sends (so the code between two stages' blocks runs on the earlier
      stage, NOTE [pipeline cut]);
    - any other block returns an ``Absent``: without running, where the probe saw it draw
      no dropout key and return a tensor shaped like its first argument, else run on its
      shadow twin (the probe's model, all ``Absent``), so that it draws its keys; and where
      nothing from the next stage's first block on draws a key, the forward stops there.

    A block of this stage given an ``Absent`` argument, a boundary tensor that is
    ``Absent`` and an ``Absent`` loss on the last stage are errors that name what depends on
    another stage.  At a boundary, a DTensor hidden state is redistributed to the layout's
    placements of the model's ``pipeline_axes`` (default ``("batch", "seq", "embed")``)
    and its local tensor sent; the receiving stage wraps it back with the same placements
    (torch 2.11 sends no DTensor between stages).  On a local root (NOTE [local root])
    the plain rows are sent as they are.

    Randomness: every stage runs micro-batch ``m``'s forward from the same CPU generator
    state, so that every stage draws the one-device keys for its micro-batches whatever
    order the schedule runs them in (NOTE [dropout keys] in meshlm/core/rng.py): the state the
    caller gives for ``m`` (``MicroBatches.starts``: ``meshlm train`` seeds it from
    (train.seed, step, m), the parity harness reseeds likewise), or else each stage's own
    chain from the step's start state, one full forward per micro-batch.  After the step
    the generator is at the state after the last micro-batch's forward, as on one device.

NOTE [side outputs]
    A block may return more than its hidden state: a tuple whose first element is the
    hidden state and whose other tensors are *side outputs* (a mixture-of-experts block's
    per-row auxiliary losses, which the model adds up over its blocks and into its loss).
    They travel down the pipeline with the hidden state, so that the last stage computes
    the loss one device computes, its value and its gradient: a stage sends the hidden
    state followed by the side outputs of every block of its own and earlier stages, in
    block order (the probe records each block's: ``Probe.sides``), and a stage returns,
    for a block of an earlier stage, the side outputs it received for it in place of
    ``Absent`` ones.  Their gradients come back with the hidden state's: the schedules'
    backward sends a gradient for every tensor a stage received.

    A side output whose first dim is the hidden state's (per row) crosses with the
    placements of ``("batch", None, ...)``, any other whole (replicated), in the dtype
    the probe saw.  Per micro-batch and boundary that is a few bytes for per-row
    auxiliary losses beside the hidden state's ``b·s·h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.core import weighting
from meshlm.core.axes import Axes
from meshlm.core.errors import ConfigError, MeshlmError
from meshlm.core.state import RUN, scope
from meshlm.runtime import hooks
from meshlm.runtime.absent import absent_like, has_absent, is_absent


@dataclass
class StageRun:
    """One forward of one stage (NOTE [stage forward])."""

    stage: int
    blocks: frozenset  # this stage's block FQNs
    first: str  # its first block
    boundary: Optional[str]  # the next stage's first block (None: the last stage)
    received: Optional[Tensor]  # from the previous stage (None: the first)
    state: Any  # the model's ShardState
    axes: Axes  # logical axes of a hidden state at a boundary
    output: Optional[Tensor] = None  # what this stage sends
    # NOTE [side outputs]: block FQN -> its side outputs, received (earlier stages' blocks)
    # or computed here (this stage's), in the order of the block's ``Probe.sides``
    sides: dict = field(default_factory=dict)
    specs: dict = field(default_factory=dict)  # block FQN -> its Probe.sides


def _absent_args(args, kwargs) -> list[str]:
    out = [f"argument {i}" for i, a in enumerate(args) if has_absent(a)]
    return out + [f"argument {k!r}" for k, v in kwargs.items() if has_absent(v)]


class _StageDone(BaseException):
    """Unwinds a stage's forward at the next stage's first block when nothing after it draws
    from torch's generator (what follows would only compute shapes).  A BaseException, so
    that a model's own ``except Exception`` does not catch it."""


def block_call(fqn: str, blk: nn.Module, twin: nn.Module, skip: bool, stop: bool = False) -> Callable:
    """The call of outer block ``fqn`` (module ``blk``) under pipeline parallelism (NOTE
    [stage forward]); ``twin``: its shadow, run in its place where it must draw keys;
    ``stop``: where it begins a stage, the forward of the stage before may end there (no
    generator draw from there on)."""

    def call(inner, *args, **kwargs):
        run = RUN.stage  # the stage forward running now (StageModule.forward), None: none
        if run is None:
            return inner(*args, **kwargs)
        if fqn == run.boundary:
            h = args[0] if args else None
            if not isinstance(h, Tensor) or is_absent(h):
                raise ConfigError(
                    f"pipeline parallelism: the first argument of block `{fqn}` (where stage {run.stage + 1} begins) "
                    f"{'is not a tensor' if not isinstance(h, Tensor) else 'depends on parameters of another stage'}"
                    f"; stage {run.stage} sends the hidden state a block takes as its first argument"
                )
            run.output = h
            if stop:
                raise _StageDone
        if fqn in run.blocks:
            if fqn == run.first and run.received is not None:
                if not args or not is_absent(args[0]):
                    raise ConfigError(
                        f"pipeline parallelism: block `{fqn}` begins stage {run.stage}, but its first argument does "
                        "not come from the blocks before it; a stage receives the hidden state a block takes as its "
                        "first argument"
                    )
                args = (receive(run, run.received, args[0]), *args[1:])
            bad = _absent_args(args, kwargs)
            if bad:
                raise ConfigError(
                    f"pipeline parallelism: block `{fqn}` (stage {run.stage}) takes {', '.join(bad)} computed from "
                    "parameters of another stage; only its first argument (the hidden state) crosses stages, so "
                    "compute the others from the model's inputs and buffers, or use a layout without pp"
                )
            out = inner(*args, **kwargs)
            if run.specs.get(fqn):
                run.sides[fqn] = [out[i] for i, _shape, _dtype in run.specs[fqn]]
            return out
        if skip:
            return absent_like(args[0])
        if twin.training != blk.training:  # dropout draws in training mode only
            twin.train(blk.training)
        out = twin(*args, **kwargs)
        if fqn in run.sides:  # a block of an earlier stage: its side outputs as received
            out = list(out)
            for (i, _shape, _dtype), t in zip(run.specs[fqn], run.sides[fqn]):
                out[i] = t
            out = tuple(out)
        return out

    return call


def boundary_placements(run: StageRun, shape, axes: Optional[Axes] = None) -> tuple:
    return run.state.activation_placements(run.axes if axes is None else axes, shape)


def side_axes(shape, rows: int) -> Axes:
    """The logical axes a side output of ``shape`` crosses stages with (NOTE [side outputs]):
    per row where its first dim is the hidden state's ``rows``, else whole."""
    if len(shape) and shape[0] == rows:
        return ("batch",) + (None,) * (len(shape) - 1)
    return (None,) * len(shape)


def side_order(cut, sides: dict, stage: int) -> list[tuple[str, tuple, torch.dtype]]:
    """(block FQN, global shape, dtype) of each side output stage ``stage`` sends, after the
    hidden state (NOTE [side outputs]): those of the blocks of stages up to ``stage``."""
    blocks = [b for st in cut.stages[: stage + 1] for b in st]
    return [(b, shape, dt) for b in blocks for _i, shape, dt in sides.get(b, ())]


def receive(run: StageRun, recv: Tensor, like: Tensor, axes: Optional[Axes] = None) -> Tensor:
    """A tensor received from the previous stage (the hidden state, or a side output with
    its ``axes``), as the forward holds it there: a copy, since torch may receive the next
    micro-batch into the same buffer while this one's autograd graph still holds it (torch
    2.11 does)."""
    st = run.state
    recv = recv.clone()  # differentiable: the gradient still reaches the received tensor
    if st.local_now:
        return recv
    pl = boundary_placements(run, like.shape, axes)
    stride = torch.empty(like.shape, device="meta").stride()
    return DTensor.from_local(recv, st.mesh, pl, run_check=False, shape=like.shape, stride=stride)


def send_value(run: StageRun, h: Tensor, axes: Optional[Axes] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """What this stage sends for hidden state ``h`` (or a side output with its ``axes``, in
    ``dtype``): a plain contiguous tensor, and not a view (torch's zero-bubble schedules
    detach a stage's output in place)."""
    if isinstance(h, DTensor):
        h = h.redistribute(h.device_mesh, boundary_placements(run, h.shape, axes)).to_local()
    if dtype is not None:
        h = h.to(dtype)
    h = h.contiguous()
    return h.clone() if compat.is_view(h) else h


@dataclass
class MicroBatches:
    """A step's micro-batches as every stage of this rank sees them: the model's inputs,
    the losses the last stage computed, and the generator state the step started from."""

    inputs: list = field(default_factory=list)  # (args, kwargs) per micro-batch
    losses: list = field(default_factory=list)  # loss per micro-batch, detached (the last stage's rank)
    weights: list = field(default_factory=list)  # its weight tensor (NOTE [token weighting]), None: unknown
    rng: Optional[Tensor] = None
    # the generator state each micro-batch's forward starts from, where the caller sets one
    # per micro-batch (meshlm train and the parity harness seed each); None: chained
    starts: Optional[list] = None


class StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs for stage ``stage`` (NOTE [stage forward]).
    ``parameters()`` are the stage's own (torch's zero-bubble schedules compute their
    weight gradients from it); the sharded model is not a submodule, so that several
    stages of one rank share it."""

    def __init__(self, model, stage: int, cut, calls: dict, probe, pick_loss: Callable, axes: Axes, mbs):
        super().__init__()
        self._sides = probe.sides  # block FQN -> its side outputs (NOTE [side outputs])
        # rows of a micro-batch's hidden state: a side output with as many crosses per row
        self.rows = (probe.shapes.get(cut.stages[0][0]) or (None,))[0]
        object.__setattr__(self, "_model", model)
        self.stage, self.cut, self.mbs = stage, cut, mbs
        self._calls = calls  # block FQN -> its outer call (block_call)
        self._pick_loss = pick_loss
        self._axes = axes
        names = set(cut.params[stage])
        self._params = [p for n, p in model.named_parameters() if n in names]
        self._mb = 0
        self._rng: Optional[Tensor] = None
        self.last = stage == len(cut.stages) - 1

    def parameters(self, recurse: bool = True):
        return iter(self._params)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        names = set(self.cut.params[self.stage])
        return ((n, p) for n, p in self._model.named_parameters() if n in names)

    def begin(self) -> None:
        """A new step: micro-batch 0, the step's generator state."""
        self._mb = 0
        self._rng = self.mbs.rng

    def end_rng(self) -> Optional[Tensor]:
        return self._rng

    def forward(self, *received):
        m = self._mb
        if m >= len(self.mbs.inputs):
            raise MeshlmError(f"pipeline stage {self.stage}: forward of micro-batch {m} of {len(self.mbs.inputs)}")
        self._mb += 1
        args, kwargs = self.mbs.inputs[m]
        if self.stage == 0 and received and received[0] is not args[0] and not torch.equal(received[0], args[0]):
            raise MeshlmError(f"pipeline stage 0: the schedule's micro-batch {m} is not the step's micro-batch {m}")
        stages = self.cut.stages
        run = StageRun(
            self.stage,
            frozenset(stages[self.stage]),
            stages[self.stage][0],
            None if self.last else stages[self.stage + 1][0],
            received[0] if self.stage > 0 else None,
            self._model._meshlm_state,
            self._axes,
            specs=self._sides,
        )
        if self.stage > 0:
            self._take_sides(run, received[1:])
        self._install()
        with compat.outside_fake():  # generator states are real tensors, also in the planner's fake step
            state = torch.get_rng_state()
            torch.set_rng_state(self._rng if self.mbs.starts is None else self.mbs.starts[m])
        out = None
        try:
            with scope(stage=run):
                out = self._model(*args, **kwargs)
        except _StageDone:
            pass  # this stage's output is captured; nothing after it draws a key
        finally:
            with compat.outside_fake():
                self._rng = torch.get_rng_state()
                torch.set_rng_state(state)
        if not self.last:
            if run.output is None:
                raise ConfigError(
                    f"pipeline parallelism: the forward never reached block `{run.boundary}`, where stage "
                    f"{self.stage + 1} begins"
                )
            return self._send(run)
        loss = self._pick_loss(out)
        if is_absent(loss):
            raise ConfigError(
                "pipeline parallelism: the loss depends on parameters of another stage (a head tied to the "
                "embedding, a skip connection around the blocks, or something a block returns after its hidden "
                "state that is not a tensor); the last stage computes the loss from the hidden state it receives, "
                "the tensors the earlier stages' blocks return beside it, and its own parameters"
            )
        self.mbs.losses[m] = loss.detach()  # read after the step (a planner's fake step has no values)
        self.mbs.weights[m] = weighting.weight_tensor(loss)  # NOTE [token weighting] in meshlm/core/weighting.py
        return loss.reshape(1)  # torch's schedules concatenate the last stage's outputs

    def _take_sides(self, run: StageRun, received: tuple) -> None:
        """The side outputs received from the previous stage, by block (NOTE [side outputs])."""
        order = side_order(self.cut, self._sides, self.stage - 1)
        if len(received) != len(order):
            raise MeshlmError(f"pipeline stage {self.stage}: {len(received)} side outputs received, {len(order)} sent")
        for (fqn, shape, _dt), t in zip(order, received):
            like = torch.empty(shape, device="meta")
            run.sides.setdefault(fqn, []).append(receive(run, t, like, side_axes(shape, self.rows)))

    def _send(self, run: StageRun):
        """The hidden state, then every side output up to this stage (NOTE [side outputs])."""
        h = send_value(run, run.output)
        order = side_order(self.cut, self._sides, self.stage)
        if not order:
            return h
        left = {fqn: list(ts) for fqn, ts in run.sides.items()}
        out = [h]
        for fqn, shape, dt in order:
            t = left[fqn].pop(0)
            if is_absent(t):
                raise ConfigError(
                    f"pipeline parallelism: block `{fqn}` returns, after its hidden state, a tensor that depends "
                    "on parameters of another stage; what a block returns besides its hidden state must come "
                    "from its own computation"
                )
            out.append(send_value(run, t, side_axes(shape, self.rows), dt))
        return tuple(out)

    def _install(self) -> None:
        """Every outer block's call goes through block_call (again, after an in-place compile)."""
        for fqn, (blk, outer) in self._calls.items():
            if not compat.outer_call_wrapped(blk, outer):
                hooks.wrap_call(blk, hooks.PIPELINE, outer)
