"""Pipeline schedules by name: torch's ``torch.distributed.pipelining`` schedules, what
each needs (stages per rank, micro-batches) checked up front, and the bubble each leaves.

NOTE [schedules]
    ``pipeline.schedule`` names one of torch's schedules; meshlm builds its stages and
    never writes one by hand:

    ==================  =====================================  ==============  ==========================
    name                torch class                            stages per rank bubble (p ranks, m micro-batches, v stages per rank)
    ==================  =====================================  ==============  ==========================
    ``gpipe``           ScheduleGPipe                          1               (p-1)/(m+p-1); holds m micro-batches' activations
    ``1f1b``            Schedule1F1B                           1               (p-1)/(m+p-1); the first stage holds at most p
    ``interleaved_1f1b`` ScheduleInterleaved1F1B               v >= 2          (p-1)/(v·m + p-1)
    ``zero_bubble``     ScheduleInterleavedZeroBubble          v >= 1          below interleaved: weight gradients fill the bubble
    ``zbv``             ScheduleZBVZeroBubble                  2 (V-shaped)    below interleaved
    ==================  =====================================  ==============  ==========================

    The micro-batches are ``train.grad_accum``: one step accumulates the gradients of
    ``train.grad_accum`` micro-batches, pipelined or not.  Each micro-batch's loss is
    divided by their number once, by meshlm (``loss / m`` before backward, as ``meshlm
    train`` accumulates without pp), and torch's own scaling is off (``scale_grads=False``):
    torch's default divides the gradients by m again after the step, which on top of
    meshlm's division would make them m times too small.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.core.errors import ConfigError


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    cls_name: str  # in torch.distributed.pipelining
    multi: bool  # takes a list of stages (several per rank)
    style: str  # stage -> rank: "loop" or "v"
    min_stages_per_rank: int
    max_stages_per_rank: int | None


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("gpipe", "ScheduleGPipe", False, "loop", 1, 1),
    "1f1b": ScheduleSpec("1f1b", "Schedule1F1B", False, "loop", 1, 1),
    "interleaved_1f1b": ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", True, "loop", 2, None),
    "zero_bubble": ScheduleSpec("zero_bubble", "ScheduleInterleavedZeroBubble", True, "loop", 1, None),
    "zbv": ScheduleSpec("zbv", "ScheduleZBVZeroBubble", True, "v", 2, 2),
}


ZERO_BUBBLE = ("zero_bubble", "zbv")


def zero_bubble_supported() -> bool:
    """Whether this torch's zero-bubble schedules train meshlm's stages right (2.13 on)."""
    from meshlm import _torch_compat as compat

    return compat.torch_at_least(2, 13)


def schedule_spec(name: str, stages_per_rank: int, pp: int, microbatches: int) -> ScheduleSpec:
    """The schedule called ``name``, checked against the run (clear errors, never a hang)."""
    from meshlm.core.axes import closest

    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline.schedule={name!r}{closest(name, SCHEDULES)}: the schedules are {', '.join(SCHEDULES)}"
        )
    spec = SCHEDULES[name]
    lo, hi = spec.min_stages_per_rank, spec.max_stages_per_rank
    if stages_per_rank < lo or (hi is not None and stages_per_rank > hi):
        want = str(lo) if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
        raise ConfigError(
            f"pipeline.schedule={name} runs {want} stage{'' if want == '1' else 's'} per rank; "
            f"pipeline.stages_per_rank={stages_per_rank}"
        )
    if name != "gpipe" and microbatches < pp:
        raise ConfigError(
            f"pipeline.schedule={name} needs at least as many micro-batches as pipeline ranks: train.grad_accum="
            f"{microbatches} < mesh.pp={pp} (raise train.grad_accum, or use pipeline.schedule=gpipe)"
        )
    if spec.multi:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"pipeline.schedule={name} runs micro-batches in rounds of mesh.pp={pp}: train.grad_accum="
                f"{microbatches} must be a multiple of {rounds}"
            )
    if spec.name in ZERO_BUBBLE and not zero_bubble_supported():
        import torch

        raise ConfigError(
            f"pipeline.schedule={name} needs torch 2.13 or newer (this is {torch.__version__}): torch 2.11's "
            "zero-bubble schedules compute wrong weight gradients for meshlm's stages (the parity tests show it) "
            "and its V schedule sends to its own rank; use interleaved_1f1b or 1f1b"
        )
    return spec


def bubble(name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a step by the schedule's formula (NOTE [schedules]); for the
    zero-bubble schedules, the interleaved bound they stay below."""
    p, m, v = pp, microbatches, stages_per_rank
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    return (p - 1) / (v * m + p - 1)


def make_schedule(spec: ScheduleSpec, stages: list, microbatches: int, loss_fn):
    """torch's schedule ``spec`` over this rank's ``stages`` (``PipelineStage`` objects)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, spec.cls_name)
    if spec.multi:
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
