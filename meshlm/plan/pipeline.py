"""``plan_pipeline``: the plan of a pipeline layout (``layers: pp``), measured per pp rank
on fake tensors: each rank's stages' model state, the activations its schedule keeps in
flight at once, every collective inside the stages, the point-to-point bytes between them
and the schedule's bubble.

NOTE [planning stages]
    For every pp rank r, this process joins a fake process group as the rank at pp
    coordinate r (the others 0), builds that rank's part of the pipeline exactly as
    ``meshlm train`` does (``meshlm.runtime.pipeline.build_pipeline``: the same cut, the same
    sharded stage model, on fake tensors), and runs the step its schedule runs on it, in the
    schedule's own order: torch's ``pipeline_order`` for the rank (the forward, backward,
    input- and weight-gradient actions of each of its stages and micro-batches), each
    forward on a fake received hidden state, each backward from a fake received gradient,
    then the optimizer step; twice, measuring the second (NOTE [fake measurement] in
    measure.py).  The receive buffers torch allocates once, one per micro-batch and
    boundary for the hidden states and one for their gradients, are held through the step
    as they are in a real one.  So the peak includes exactly the activations the schedule
    keeps in flight on that rank (1F1B: at most p micro-batches on the first stage; GPipe:
    all m), zero-bubble schedules' input- and weight-gradient halves with torch's own
    functions (the intermediates an ``I`` leaves for its ``W`` held until it runs).  What
    the emulation cannot see is how torch keeps its buffers (received gradients until
    they are sent on, and the like): measured against real steps, the peak is within the
    rank's receive-buffer bytes (tests/dist/test_pipeline.py).

    Point-to-point bytes come from the cut: per micro-batch, each boundary between ranks
    sends the hidden state forward and its gradient back (NOTE [pipeline cut]), with the
    side outputs of the blocks before it (NOTE [side outputs] in
    meshlm/runtime/pipeline/stage.py: a mixture of experts' auxiliary losses); the step's
    loss all-reduce over pp is added.  The plan's memory is the fullest rank's, its
    collectives that rank's, and ``formulas["stages"]`` holds every rank's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, Optional

import torch

from meshlm import _torch_compat as compat
from meshlm.core.errors import ConfigError
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.rules import load_layout
from meshlm.plan.measure import Build, _WaitIsIdentity
from meshlm.plan.report import CommEntry, Plan, _name


def actions(pipe, spec, microbatches: int, stages: list) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of every compute action of this rank's step, in its
    schedule's order: torch's ``pipeline_order`` for the schedules that run from one, else GPipe's
    (every forward, then every backward) or 1F1B's (warm-up forwards, then one backward
    and one forward each, then the remaining backwards)."""
    from meshlm.runtime.pipeline.schedule import make_schedule

    if spec.multi:  # torch runs these from their pipeline_order (its single-stage schedules do not)
        order = make_schedule(spec, stages, microbatches, lambda out, _t: out).pipeline_order
        acts = [a for a in order.get(pipe.pp_rank, []) if a is not None]
        kinds = [(getattr(a.computation_type, "value", str(a.computation_type)), a) for a in acts]
        return [(k, a.stage_index, a.microbatch_index) for k, a in kinds if k in ("F", "B", "I", "W")]
    (s,) = [sm.stage for sm in pipe.stage_modules]
    n = len(pipe.cut.stages)
    if spec.name == "gpipe":
        return [("F", s, m) for m in range(microbatches)] + [("B", s, m) for m in range(microbatches)]
    warm = min(microbatches, n - s)
    out = [("F", s, m) for m in range(warm)]
    f, b = warm, 0
    while b < microbatches:
        out.append(("B", s, b))
        b += 1
        if f < microbatches:
            out.append(("F", s, f))
            f += 1
    return out


def _emulate(pipe, order, inputs, recv: dict) -> None:
    """One step of this rank's actions on fake tensors (NOTE [planning stages]).  A stage
    fed by a stage of this rank takes that stage's output itself, and hands its gradient
    back the same way (zbv's V); across ranks, torch's receive buffers (``recv``)."""
    here = {sm.stage: sm for sm in pipe.stage_modules}
    n = len(pipe.cut.stages)
    live: dict = {}  # (stage, micro-batch) -> (input, output) until its backward
    handed: dict = {}  # (stage, micro-batch) -> the gradient of its output, from the next stage on this rank
    groups: dict = {}  # (stage, micro-batch) -> what its W needs (zero-bubble schedules)
    pipe.begin(inputs)
    # what Pipeline.step and torch's schedule keep through a step besides: the step's tokens
    # (concatenated, and their chunks), the targets torch splits, and on the last stage
    # each micro-batch's output and scaled loss
    kept = [torch.cat([a[0] for a, _k in inputs]), torch.arange(pipe.microbatches)]
    if (n - 1) in here:
        kept += [torch.empty(1) for _ in range(2 * pipe.microbatches)]
    for kind, s, m in order:
        sm = here[s]
        if kind == "F":
            if s == 0:
                inp = (inputs[m][0][0],)
            else:  # the hidden state and any side outputs (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py)
                got = live[(s - 1, m)][1] if (s - 1) in here else recv[("fwd", s)][m]
                inp = tuple(t.detach().requires_grad_(True) for t in got)
            out = sm(*inp)
            live[(s, m)] = (inp, out if isinstance(out, tuple) else (out,))
        elif kind in ("B", "I"):
            inp, out = live.pop((s, m))
            if s == n - 1:
                outs, grads = [out[0].sum() / pipe.microbatches], None
            else:
                back = handed.pop((s, m)) if (s + 1) in here else recv[("bwd", s)][m]
                # a side output the loss does not use (its coefficients 0) has or gets no gradient
                kept = [(o, g) for o, g in zip(out, back) if g is not None and o.requires_grad]
                outs, grads = [o for o, _g in kept], [g for _o, g in kept]
            if kind == "B":
                torch.autograd.backward(outs, grads)
                g = tuple(t.grad for t in inp) if inp[0].requires_grad else None
            elif s == 0:  # torch's first stage has no input gradient: all of its backward runs at W
                groups[(s, m)], g = ("full", outs, grads), None
            else:  # input gradients now, weight gradients at this micro-batch's W (torch's zero bubble)
                g, pg = compat.stage_backward_input(outs, grads, list(inp), sm.parameters())
                g = tuple(g)
                groups[(s, m)] = ("weight", pg)
            if s > 0 and (s - 1) in here:
                handed[(s - 1, m)] = g
        elif kind == "W":
            what, *rest = groups.pop((s, m))
            if what == "full":
                torch.autograd.backward(*rest)
            else:
                compat.stage_backward_weight(sm.parameters(), rest[0])
    assert not live, f"pipeline plan: actions left {sorted(live)} without a backward"
    del kept


def _measure_rank(build, lay, sizes: dict, r: int, micro: int, seq: int, m: int, ac: str, kw: dict, pcfg: dict):
    """(memory, collectives, flops, stage indices) of pp rank ``r``."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from meshlm.core import state as run_state
    from meshlm.layout.mesh import init_fake
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.memory import PeakStorage, model_state_bytes
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh, schedule_spec

    world = math.prod(sizes.values())
    init_fake(world, rank=r)  # pp is the innermost mesh axis: rank r has pp coordinate r, the others 0
    saved = run_state.swap(fake_eager=True)  # NOTE [fake eager] in meshlm/core/state.py
    try:
        mesh, sub = pipeline_mesh(sizes)
        with compat.fake_tensor_mode(allow_non_fake_inputs=True), _WaitIsIdentity():
            tok = torch.zeros(micro, seq, dtype=torch.long)
            pipe = build_pipeline(
                build, lay, mesh, sub, example=((tok, tok), {}), microbatches=m, init=False, **pcfg, **kw
            )
            apply_activation_checkpointing(pipe.model, ac)
            opt = ShardedOptimizer(pipe.model, torch.optim.AdamW, lr=1e-3)
            from meshlm.runtime.lowering.inputs import shard_batch

            x = shard_batch(torch.zeros(micro, seq, dtype=torch.long), lay, sub)
            inputs = [((x, x), {}) for _ in range(m)]
            spec = schedule_spec(pcfg["schedule"], pcfg["stages_per_rank"], pipe.pp, m)
            order = actions(pipe, spec, m, pipe._stages(x))
            recv = {}
            ranks = pipe.cut.ranks
            for sm in pipe.stage_modules:  # torch's receive buffers: one per micro-batch and boundary between ranks
                s = sm.stage
                if s > 0 and ranks[s - 1] != ranks[s]:
                    recv[("fwd", s)] = [_buffers(pipe, s) for _ in range(m)]
                if s < len(ranks) - 1 and ranks[s + 1] != ranks[s]:
                    recv[("bwd", s)] = [_buffers(pipe, s + 1) for _ in range(m)]

            def step(actions=order, cc=None):
                with pipe.gathering():
                    _emulate(pipe, actions, inputs, recv)
                grads = model_state_bytes(pipe.model, opt)["grads"]
                with cc.phase("optimizer") if cc is not None else contextlib.nullcontext():
                    opt.step()
                grads = max(grads, model_state_bytes(pipe.model, opt)["grads"])
                opt.zero_grad()
                return grads

            # FLOPs in the first step, each input-gradient half run as a whole backward and
            # its weight half dropped (the same FLOPs): FlopCounterMode's module hooks cannot
            # see the autograd.grad of torch's split backward
            flops = FlopCounterMode(display=False)
            with flops:
                step([("B", s, m) if k == "I" else (k, s, m) for k, s, m in order if k != "W"])
            seed = (
                list(pipe.model.parameters())
                + list(opt.masters().values())
                + [v for s in opt.inner.state.values() for v in s.values() if torch.is_tensor(v)]
                + [t for bufs in recv.values() for ts in bufs for t in ts]
            )
            cc, peak = CommCounter(mesh), PeakStorage(seed)
            with cc, peak:
                grads = step(cc=cc)
            state = model_state_bytes(pipe.model, opt)
            memory = {"params": state["params"], "grads": grads, "optimizer": state["optimizer"], "peak": peak.peak}
            memory["activations"] = peak.peak - sum(memory[k] for k in ("params", "grads", "optimizer"))
            p2p = _p2p(pipe, m)
            return memory, cc, int(flops.get_total_flops()), [sm.stage for sm in pipe.stage_modules], p2p, pipe
    finally:
        run_state.restore(saved)
        if dist.is_initialized():
            dist.destroy_process_group()
        compat.clear_dtensor_caches()


def _buffers(pipe, stage: int) -> tuple:
    """torch's receive buffers for what enters ``stage``: the hidden state and any side outputs."""
    return tuple(torch.empty(shape, dtype=dt) for shape, dt in pipe.boundary_tensors(stage))


def _p2p(pipe, m: int) -> dict[str, tuple[int, int]]:
    """This rank's sends and receives per step (count, bytes): per micro-batch and stage
    boundary between ranks, the hidden state forward and its gradient back."""
    out = {"send": [0, 0], "recv": [0, 0]}
    ranks = pipe.cut.ranks
    for sm in pipe.stage_modules:
        s = sm.stage
        for nb, cross in (
            (s + 1, s + 1 < len(ranks) and ranks[s + 1] != ranks[s]),
            (s, s > 0 and ranks[s - 1] != ranks[s]),
        ):
            if cross:
                for shape, dt in pipe.boundary_tensors(nb):
                    b = math.prod(shape) * torch.empty((), dtype=dt).element_size()
                    for k in ("send", "recv"):
                        out[k][0] += m
                        out[k][1] += m * b
    return {k: tuple(v) for k, v in out.items()}


def plan_pipeline(
    build: Build,
    layout,
    mesh: "Mapping[str, int] | str | MeshSpec",
    *,
    global_batch: int,
    seq: int,
    grad_accum: int,
    activation_checkpointing: str = "none",
    shard_kw: "Mapping | None" = None,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    split: Optional[list] = None,
    regather: bool = False,
    name: str = "model",
) -> Plan:
    """The plan of ``build`` under pipeline ``layout`` on ``mesh`` (NOTE [planning stages])."""
    import torch.distributed as dist

    from meshlm.runtime.pipeline.schedule import bubble

    lay = load_layout(layout)
    spec = MeshSpec.parse(mesh)
    sizes = {a: n for a, n in spec.axes if n > 1}
    if dist.is_initialized() and dist.get_backend() != "fake":
        raise ConfigError("meshlm plan measures on a fake process group; plan before the process group starts")
    kw = dict(shard_kw or {})
    pcfg = {"schedule": schedule, "stages_per_rank": stages_per_rank, "split": split, "regather": regather}
    micro = global_batch // grad_accum
    ranks = []
    for r in range(sizes["pp"]):
        try:
            ranks.append(
                _measure_rank(build, lay, sizes, r, micro, seq, grad_accum, activation_checkpointing, kw, pcfg)
            )
        except compat.fake_unsupported_errors() as e:
            raise ConfigError(
                f"meshlm plan could not measure pipeline layout {lay.name} on mesh {sizes}: the fake step hit an op "
                f"that needs real data ({type(e).__name__}: {e})"
            ) from None
    worst = max(range(len(ranks)), key=lambda i: ranks[i][0]["peak"])
    memory, cc, flops, _stages, p2p, pipe = ranks[worst]
    comm: dict[tuple, CommEntry] = {}
    for rec in cc.records:
        e = comm.setdefault(
            (rec.kind, rec.axes, rec.phase), CommEntry(rec.kind, rec.axes, rec.phase, 0, 0, 0.0, "counted")
        )
        e.count += 1
        e.bytes += rec.bytes
        e.wire_bytes += rec.wire_bytes
    for kind, (n, b) in p2p.items():
        if n:
            comm[(kind, ("pp",), "forward")] = CommEntry(
                kind,
                ("pp",),
                "forward",
                n,
                b,
                float(b if kind == "send" else 0),
                "activations and their gradients between stages",
            )
    comm[("all_reduce", ("pp",), "optimizer")] = CommEntry(
        "all_reduce", ("pp",), "optimizer", 1, 8, 2 * 8 * (sizes["pp"] - 1) / sizes["pp"], "the step's loss"
    )
    sd = kw.get("param_dtype") or torch.float32
    cd = kw.get("compute_dtype") or sd
    rd = kw.get("reduce_dtype") or (torch.float32 if cd != torch.float32 or sd != torch.float32 else sd)
    stages = [
        {
            "pp_rank": i,
            "stages": st,
            "blocks": [len(pipe.cut.stages[s]) for s in st],
            **mem,
            "send_bytes": pp2["send"][1],
            "recv_bytes": pp2["recv"][1],
        }
        for i, (mem, _cc, _f, st, pp2, _p) in enumerate(ranks)
    ]
    formulas = {
        "psi": sum(pipe.probe.numel.values()),
        "flops": flops,
        "bubble": bubble(schedule, sizes["pp"], grad_accum, stages_per_rank),
        "schedule": schedule,
        "stages": stages,
        "zero": None,
    }
    return Plan(
        name,
        lay.name,
        sizes,
        spec.size,
        global_batch,
        seq,
        _name(sd),
        _name(sd),
        activation_checkpointing,
        dict(memory, total=memory["peak"]),
        formulas,
        list(comm.values()),
        _name(cd),
        _name(rd),
    )


__all__ = ["actions", "plan_pipeline"]
