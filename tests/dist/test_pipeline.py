"""Pipeline parallelism (meshlm/runtime/pipeline/): every pp layout and schedule against one device,
its point-to-point bytes against the analytic activation sends, the gradient reduction
once per step, and the traps torch's schedules set.

Parity is ``check_training`` (tests/harness/parity.py, through tests/harness/parity_pp.py):
three optimizer steps of SGD (momentum) and AdamW on pp alone, two of SGD inside the 2-D
and 3-D meshes, each over ``grad_accum`` micro-batches that are the pipeline's, checked on
each micro-batch loss, the gradient each optimizer steps with, the parameters and the
optimizer state, on 2, 4 and 8 gloo processes (8 for pp=2 x fsdp=2 x tp=2), eager and
aot_eager.  The model is the reference Llama with 4 blocks (so 2 stages per rank fit on
pp=2; 2 blocks on 8 processes and in the planner's schedule comparison); dropout and the
user's model are checked too.
"""

from __future__ import annotations

import pytest
import torch

from meshlm.runtime.pipeline.schedule import zero_bubble_supported
from harness import dist_pool_fixture
from harness.parity import LlamaBuild, assert_parity, check_training

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)
pool8 = dist_pool_fixture(8, timeout_s=120)

LLAMA4 = LlamaBuild("llama_tiny", (("layers", 4),))
LLAMA2 = LlamaBuild("llama_tiny")  # 2 blocks: one stage each on pp=2
# torch 2.11's zero-bubble schedules are refused (meshlm.runtime.pipeline.schedule.zero_bubble_supported)
ZB = pytest.mark.skipif(not zero_bubble_supported(), reason="zero-bubble schedules need torch >= 2.13")
SCHEDULES = [
    ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
    pytest.param("zero_bubble", 1, marks=ZB), pytest.param("zbv", 2, marks=ZB),
]
V2 = "zbv" if zero_bubble_supported() else "interleaved_1f1b"  # a two-stages-per-rank schedule this torch runs


_ok = assert_parity


def _parity(layout, mesh, schedule, v, grad_accum=2, **kw):
    return check_training(layout, mesh, build=LLAMA4, grad_accum=grad_accum, schedule=schedule, stages_per_rank=v, **kw)


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
def test_pp_2(pool2, schedule, v):
    _ok(pool2.run(_parity, "pp", "pp=2", schedule, v))


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
def test_fsdp_pp_4(pool4, schedule, v):
    """FSDP inside each stage: gathered at use, gradients reduced once at the step."""
    _ok(pool4.run(_parity, "fsdp_pp", "fsdp=2,pp=2", schedule, v, optims=("sgd",), steps=2))


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
def test_fsdp_tp_pp_4(pool4, schedule, v):
    """Tensor parallelism inside each stage (tp=2, pp=2; fsdp drops out): DTensor blocks,
    the hidden state sent as local tensors (NOTE [stage forward]), every schedule."""
    _ok(pool4.run(_parity, "fsdp_tp_pp", "tp=2,pp=2", schedule, v, optims=("sgd",), steps=2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_4_stages(pool4, schedule):
    """Four stages of one block each; gpipe with fewer micro-batches than stages."""
    _ok(pool4.run(_parity, "pp", "pp=4", schedule, 1, 2 if schedule == "gpipe" else 4, optims=("sgd",)))


def test_fsdp_tp_pp_8(pool8):
    """3-D: pp=2 x fsdp=2 x tp=2, tensor-parallel DTensor blocks inside the stages (their
    hidden state sent as local tensors, NOTE [stage forward]), one block a stage (the 3-D mesh
    is the point: several blocks a stage run on 4 above); compiled below, on 4."""
    _ok(pool8.run(check_training, "fsdp_tp_pp", "fsdp=2,tp=2,pp=2", build=LLAMA2, schedule="1f1b",
                  optims=("sgd",), steps=2))


def test_fsdp_tp_pp_compiled(pool4):
    """The 3-D layout's tensor-parallel stages compiled per block (aot_eager), on tp=2 x pp=2
    (compiling on 8 processes of 2 cores took 41 s; the compiled DTensor blocks are the same)."""
    _ok(pool4.run(_parity, "fsdp_tp_pp", "tp=2,pp=2", "1f1b", 1, compile="aot_eager", optims=("sgd",), steps=2))


@pytest.mark.parametrize("layout,mesh,schedule,v", [
    ("pp", "pp=2", "1f1b", 1),
    ("fsdp_pp", "fsdp=2,pp=2", V2, 2),  # zero bubble: weight gradients outside autograd.backward, compiled blocks
])
def test_pp_compiled_aot_eager(pool2, pool4, layout, mesh, schedule, v):
    pool = pool2 if mesh == "pp=2" else pool4
    _ok(pool.run(_parity, layout, mesh, schedule, v, compile="aot_eager", optims=("sgd",), steps=2))


def test_pp_dropout_is_the_one_device_mask(pool4):
    """meshlm.dropout under pp: every stage draws the one-device keys for its blocks, in any
    schedule's order (NOTE [stage forward]), with activation checkpointing per block: the
    checkpointed forward draws them as a plain forward does, and its recomputation again."""
    build = LlamaBuild("llama_tiny", (("layers", 4), ("dropout", 0.2)))
    _ok(pool4.run(check_training, "fsdp_pp", "fsdp=2,pp=2", build=build, schedule=V2, stages_per_rank=2,
                  optims=("sgd",), activation_checkpointing="full"))


def _scale_grads_twice(layout, mesh):
    """torch's own 1/micro-batches (scale_grads=True) on top of meshlm's: check_training says."""
    from meshlm.runtime.pipeline import pipe as pipe_mod

    saved = pipe_mod.make_schedule

    def make(spec, stages, microbatches, loss_fn):
        import torch.distributed.pipelining as pipelining

        cls = getattr(pipelining, spec.cls_name)
        return cls(stages if spec.multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)

    pipe_mod.make_schedule = make
    try:
        _parity(layout, mesh, "1f1b", 1, optims=("sgd",), steps=1)
        return None
    except AssertionError as e:
        return str(e)
    finally:
        pipe_mod.make_schedule = saved


def test_parity_catches_torchs_gradient_scaling_on_top(pool2):
    """The trap: torch's schedules divide the gradients by the number of micro-batches by
    default.  meshlm divides each loss once and turns torch's off; with it left on, the
    gradient the optimizer steps with is half what it should be, far beyond its tolerance."""
    for msg in pool2.run(_scale_grads_twice, "pp", "pp=2"):
        assert msg is not None and "gradient of" in msg, msg
        assert float(msg.split("exceeds its tolerance ")[1].split("x")[0]) > 1e3, msg


# --------------------------------------------------------------------------- bytes
def _one_step_counted(layout, mesh, schedule, v, microbatches):
    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh

    B, S = 8, 16
    full, sub = pipeline_mesh(mesh)
    micro = B // microbatches
    ex = torch.zeros(micro, S, dtype=torch.long)
    pipe = build_pipeline(lambda d: LLAMA4(d, 0), layout, full, sub,
                          example=((ex, ex), {}), microbatches=microbatches, schedule=schedule, stages_per_rank=v)
    opt = ShardedOptimizer(pipe.model, torch.optim.SGD, lr=0.1)
    opt.norm_groups = [pipe.group]
    toks = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    lay = meshlm.load_layout(layout)

    def inputs():
        out = []
        for m in range(microbatches):
            x, y = toks[m * micro:(m + 1) * micro, :-1], toks[m * micro:(m + 1) * micro, 1:]
            out.append(((meshlm.shard_batch(x, lay, sub), meshlm.shard_batch(y, lay, sub)), {}))
        return out

    pipe.step(inputs())  # warm-up
    opt.zero_grad()
    cc = CommCounter(full)
    pf = pipe.model._meshlm_state.prefetch
    before = dict(pf.stats)
    with cc:
        pipe.step(inputs())
        ahead = {k: v - before[k] for k, v in pf.stats.items()}
        ahead["blocks"] = len(pf.order)
        with cc.phase("optimizer"):
            opt.clip_grad_norm_(1e9)
            opt.step()
    summary = {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary().items()}
    boundary = {s: pipe.boundary_shape(pipe.cut.stages[s][0]) for s in range(1, len(pipe.cut.stages))}
    nbytes = {s: torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for s, (shape, dt) in
              boundary.items()}
    return summary, list(pipe.cut.ranks), [sm.stage for sm in pipe.stage_modules], nbytes, pipe.pp_rank, ahead


def _expected_p2p(ranks, mine, nbytes, microbatches):
    """Sends and receives per step of a rank holding stages ``mine``: each micro-batch's
    hidden state forward across every boundary to another rank, and its gradient back."""
    sends = recvs = 0
    n_send = n_recv = 0
    for s in mine:
        if s + 1 < len(ranks) and ranks[s + 1] != ranks[s]:  # forward out, gradient in
            sends += microbatches * nbytes[s + 1]
            recvs += microbatches * nbytes[s + 1]
            n_send += microbatches
            n_recv += microbatches
        if s > 0 and ranks[s - 1] != ranks[s]:  # forward in, gradient out
            recvs += microbatches * nbytes[s]
            sends += microbatches * nbytes[s]
            n_send += microbatches
            n_recv += microbatches
    return (n_send, sends), (n_recv, recvs)


@pytest.mark.parametrize("layout,mesh,schedule,v,world", [
    ("pp", "pp=4", "1f1b", 1, 4),
    ("fsdp_pp", "fsdp=2,pp=2", "interleaved_1f1b", 2, 4),
    ("fsdp_pp", "fsdp=2,pp=2", V2, 2, 4),
])
def test_p2p_bytes_are_the_activation_sends(pool4, layout, mesh, schedule, v, world):
    """Point-to-point bytes per step per rank equal the analytic activation sends: per
    micro-batch and stage boundary, the hidden state forward and its gradient back
    (b·s·h·B each, b this rank's rows), nothing between stages on one rank (zbv's V)."""
    M = 4
    for summary, ranks, mine, nbytes, _r, _ahead in pool4.run(_one_step_counted, layout, mesh, schedule, v, M):
        sends, recvs = _expected_p2p(ranks, mine, nbytes, M)
        assert summary.get(("send", ("pp",)), (0, 0)) == sends, (summary, ranks, mine)
        assert summary.get(("recv", ("pp",)), (0, 0)) == recvs, (summary, ranks, mine)
        # pp's collectives besides: the step's loss with its total and reference weights (NOTE
        # [token weighting] in meshlm/core/weighting.py), 24 bytes, and the gradient norm, 8 bytes
        assert summary[("all_reduce", ("pp",))] == (2, 32), summary


def test_fsdp_gathers_and_reduces_once_per_step(pool4):
    """With 4 micro-batches as with 2, each stage all-gathers its parameters and
    reduce-scatters their gradients once a step: the same counts and bytes (NOTE [gathered
    once per step]; not once, or twice, per micro-batch, as FSDP2 under torchtitan's
    pipelines)."""
    one = pool4.run(_one_step_counted, "fsdp_pp", "fsdp=2,pp=2", "1f1b", 1, 2)
    four = pool4.run(_one_step_counted, "fsdp_pp", "fsdp=2,pp=2", "1f1b", 1, 4)
    for a, b in zip(one, four):
        for kind in ("reduce_scatter", "all_gather"):
            ka = {k: v for k, v in a[0].items() if k[0] == kind}
            kb = {k: v for k, v in b[0].items() if k[0] == kind}
            assert ka and ka == kb, (kind, ka, kb)
        # every block's gather issued at the step's start and taken by its first forward (NOTE
        # [stage gathers ahead]): none gathered again, none dropped
        ahead = b[5]
        assert ahead["blocks"] > 0 and ahead == {"issued": ahead["blocks"], "used": ahead["blocks"], "stale": 0,
                                                 "blocks": ahead["blocks"]}, ahead


def test_fsdp_pp_regathering_at_every_use(pool4):
    """pipeline.regather: ZeRO-3's gather at every use (forward, and again in backward)
    inside the stages, same numbers."""
    _ok(pool4.run(_parity, "fsdp_pp", "fsdp=2,pp=2", "1f1b", 1, 4, optims=("sgd",), shard_kw={"regather": True}))


# --------------------------------------------------------------------------- the planner
def _real_memory(layout, mesh, schedule, v, microbatches):
    """One real step measured as meshlm train measures its own (NOTE [run memory]), after a
    warm-up step; and this rank's sends and receives."""
    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.memory import model_state_bytes
    from meshlm.train.metrics import StepMemory
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh

    B, S = 8, 16
    full, sub = pipeline_mesh(mesh)
    micro = B // microbatches
    ex = torch.zeros(micro, S, dtype=torch.long)
    pipe = build_pipeline(lambda d: LLAMA4(d, 0), layout, full, sub, example=((ex, ex), {}),
                          microbatches=microbatches, schedule=schedule, stages_per_rank=v)
    opt = ShardedOptimizer(pipe.model, torch.optim.AdamW, lr=1e-3)
    x = meshlm.shard_batch(torch.zeros(micro, S, dtype=torch.long), meshlm.load_layout(layout), sub)
    inputs = [((x, x), {}) for _ in range(microbatches)]
    pipe.step(inputs)
    opt.step()
    opt.zero_grad()
    cc = CommCounter(full)
    with StepMemory(pipe.model, opt, torch.device("cpu")) as mem, cc:
        pipe.step(inputs)
        mem.after_backward()
        opt.step()
        grads = max(mem.grads, model_state_bytes(pipe.model, opt)["grads"])
        opt.zero_grad()
    sent = {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary().items() if k[0] in ("send", "recv")}
    return dict(mem.result, grads=grads, slack=mem.backend_slack, rank=pipe.pp_rank, sent=sent)


@pytest.mark.parametrize("layout,mesh,schedule,v,m,world", [
    ("pp", {"pp": 2}, "1f1b", 1, 4, 2),
    ("pp", {"pp": 2}, "gpipe", 1, 4, 2),
    ("pp", {"pp": 2}, "interleaved_1f1b", 2, 4, 2),
    ("fsdp_pp", {"fsdp": 2, "pp": 2}, V2, 2, 4, 4),
    ("pp", {"pp": 4}, "gpipe", 1, 2, 4),
], ids=["1f1b", "gpipe", "interleaved", "fsdp_pp-zbv", "pp4-gpipe"])
def test_planned_stages_are_the_real_ones(pool2, pool4, layout, mesh, schedule, v, m, world):
    """meshlm plan of a pipeline (NOTE [planning stages]): every pp rank's parameters,
    gradients and optimizer state to the byte, its sends and receives to the byte, and its
    peak within the bytes of the step's point-to-point tensors (what the fake step cannot
    see is when torch allocates and lets go of its receive buffers and of the tensors it is
    sending) and the gloo slack (NOTE [storage the backend frees]).  A micro-batch's
    activations on a stage are several times that, so a wrong count of micro-batches in
    flight fails."""
    from meshlm.plan import plan_model

    plan = plan_model(lambda d: LLAMA4(d, 0), layout, mesh, global_batch=8, seq=16, grad_accum=m,
                      pipeline={"schedule": schedule, "stages_per_rank": v})
    got = (pool2 if world == 2 else pool4).run(_real_memory, layout, mesh, schedule, v, m)
    for g in got:
        st = plan.formulas["stages"][g["rank"]]
        assert {k: st[k] for k in ("params", "grads", "optimizer")} == {k: g[k] for k in ("params", "grads", "optimizer")}
        assert g["sent"].get(("send", ("pp",)), (0, 0))[1] == st["send_bytes"], (g["sent"], st)
        assert g["sent"].get(("recv", ("pp",)), (0, 0))[1] == st["recv_bytes"], (g["sent"], st)
        tol = st["send_bytes"] + st["recv_bytes"] + g["slack"]
        assert abs(g["peak"] - st["peak"]) <= tol, (g["rank"], g["peak"], st["peak"], tol)


def test_1f1b_holds_fewer_micro_batches_than_gpipe_on_the_first_stage():
    """The planner's in-flight activations follow the schedule: on the first stage GPipe
    holds every micro-batch (two more micro-batches of 2 sequences: two more micro-batches'
    activations), 1F1B at most p = 2 whatever their number (two more: only their buffers)."""
    from meshlm.plan import plan_model

    def first(schedule, m):
        p = plan_model(lambda d: LLAMA2(d, 0), "pp", {"pp": 2}, global_batch=2 * m, seq=8, grad_accum=m,
                       pipeline={"schedule": schedule})
        return p.formulas["stages"][0]["activations"]

    g4, g6, o4, o6 = first("gpipe", 4), first("gpipe", 6), first("1f1b", 4), first("1f1b", 6)
    # 1F1B grows by the two micro-batches' receive buffers and tokens only, GPipe by their activations
    assert g4 > o4 and g6 - g4 > 4 * (o6 - o4), (g4, g6, o4, o6)
