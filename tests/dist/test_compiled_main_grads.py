"""bf16 ZeRO-1/2 (bf16 storage, float32 main gradients: NOTE [main grads] in
meshlm/runtime/main_grad.py) under ``torch.compile`` per block.

Main gradients are added in the eager Python code of the gradient reductions, so they
need ``compile_blocks(comms="eager")`` (NOTE [compiled body] in meshlm/runtime/compile.py): the
blocks' math is compiled and the reductions run around it.  Such a run trains as the
uncompiled one does.  With ``comms="graph"`` the reductions would be traced into the block
graphs, whose parameters then get no gradient at all: ``compile_blocks`` refuses, and
``meshlm train`` never asks for it (it keeps float32 storage then: ``precision.main_grads_allowed``).

2 gloo processes, llama_tiny, aot_eager.
"""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=120)

STEPS, ACCUM = 2, 2
HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _bf16_zero(layout: str):
    """llama_tiny sharded as ``meshlm train`` shards ``layout`` in bf16 on dp=2, with its
    optimizer."""
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.models import Llama, llama_config
    from meshlm.app.train import shard_dtypes

    mesh = meshlm.make_mesh("dp=2")
    lay = meshlm.load_layout(layout)
    kw = shard_dtypes(TrainConfig(param_dtype="bfloat16", compile="aot_eager", compile_comms="eager"), lay,
                      {"dp": 2})
    assert kw["grad_dtype"] == torch.float32 and kw["param_dtype"] == torch.bfloat16, kw
    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), lay, mesh, seed=0, **kw)
    return mesh, model


def _lockstep_job(layout: str):
    """The same bf16 ``layout`` run uncompiled and compiled per block (aot_eager, eager
    comms) side by side on the same micro-batches: the worst ratio of each difference to
    its tolerance (losses, the optimizer's float32 gradients, masters, AdamW state), the
    largest absolute differences, and how many parameters had main gradients."""
    import meshlm
    from meshlm.runtime import main_grad
    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from harness import tolerances as tol

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        mesh, model = _bf16_zero(layout)
        if compiled:
            compile_blocks(model, "aot_eager", comms="eager")
        runs.append((model, ShardedOptimizer(model, torch.optim.AdamW, **HP)))

    def full(t):
        return t.full_tensor().detach().clone()

    gen = torch.Generator().manual_seed(1)
    worst = {"loss": 0.0, "grad": 0.0, "master": 0.0, "state": 0.0}
    diff = dict.fromkeys(worst, 0.0)
    mains = []
    (_, eager_opt), _ = runs
    bounds = {fqn: tol.StepBounds() for fqn in eager_opt.masters()}

    def check(key, err, bound):
        worst[key] = max(worst[key], tol.ratio(err, bound))
        diff[key] = max(diff[key], float(err.abs().max()))

    for k in range(1, STEPS + 1):
        losses = [[], []]
        for _ in range(ACCUM):
            toks = torch.randint(0, 256, (8, 17), generator=gen)
            x, y = meshlm.shard_batch(toks[:, :-1], layout, mesh), meshlm.shard_batch(toks[:, 1:], layout, mesh)
            for r, (model, _opt) in enumerate(runs):
                loss = model(x, y)
                (loss / ACCUM).backward()
                losses[r].append(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        for le, lc in zip(*losses):
            check("loss", lc - le, tol.LOSS_RTOL * le.abs())
        mains.append([sum(main_grad.get(p) is not None for p in m.parameters()) for m, _o in runs])
        for _model, opt in runs:
            opt.reduce_grads()
        (_, oe), (_, oc) = runs
        me, mc = oe.masters(), oc.masters()
        grads = {f: full(me[f].grad) for f in me}
        for f, g in grads.items():  # a parameter with no gradient: a gradient of 0
            got = full(mc[f].grad) if mc[f].grad is not None else torch.zeros_like(g)
            check("grad", got - g, tol.grad_tol(g))
        old = {f: full(m) for f, m in me.items()}
        for _model, opt in runs:
            opt.step()
            opt.zero_grad()
        for f, m in me.items():
            # the eager run is the reference and its own probe: both runs start every step
            # from the same weights (checked by the masters' bound of the step before)
            state = {key: (full(v) if hasattr(v, "full_tensor") else v) for key, v in oe.inner.state[m].items()}
            w = full(m)
            bounds[f].update("adamw", HP, k, grads[f], grads[f], state, old[f], w)
            check("master", full(mc[f]) - w, bounds[f].bound["param"])
            mine = oc.inner.state.get(mc[f], {})  # none: the parameter never had a gradient
            for key in ("exp_avg", "exp_avg_sq"):
                got = full(mine[key]) if key in mine else torch.zeros_like(state[key])
                check("state", got - state[key], bounds[f].bound[key])
    n_params = len(list(runs[0][0].parameters()))
    return worst, diff, mains, n_params


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_bf16_zero_compiled_eager_comms_matches_eager(pool2, layout):
    """Losses and the optimizer's float32 gradients within the one-step tolerances, masters
    and AdamW state within the bounds those propagate through AdamW (``StepBounds``; the
    same tolerances as the compiled parity tests, tests/harness/tolerances.py), every
    parameter with main gradients in both runs.  Measured (2 ranks): bitwise equal."""
    for worst, diff, mains, n_params in pool2.run(_lockstep_job, layout):
        assert all(m == [n_params, n_params] for m in mains), f"{layout}: parameters with main grads {mains}"
        print(f"{layout}: error / tolerance {worst}, largest errors {diff}")
        assert all(v <= 1.0 for v in worst.values()), f"{layout}: error / tolerance {worst} (errors {diff})"


def _graph_comms_job(layout: str, comms: str):
    """compile_blocks(comms=...) on a bf16 ZeRO model: the error's type and message."""
    from meshlm.runtime.compile import compile_blocks

    torch._dynamo.reset()
    _mesh, model = _bf16_zero(layout)
    try:
        compile_blocks(model, "aot_eager", comms=comms)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_main_grads_refuse_graph_comms(pool2, layout):
    """comms="graph" would trace the reductions, main-gradient adds included, into the
    block graphs (measured before compile_blocks refused: no block parameter got a
    gradient, only the 3 outside the blocks): a ConfigError that says what to do."""
    for kind, msg in pool2.run(_graph_comms_job, layout, "graph"):
        assert kind == "ConfigError", (kind, msg)
        assert "main gradients" in msg and "comms='eager'" in msg and "compile_comms=eager" in msg, msg


def test_train_keeps_fp32_storage_for_graph_comms():
    """``meshlm train`` with compile_comms=graph shards ZeRO-1/2 with float32 storage and no
    main gradients (the documented fallback), with eager comms or no compile at the floor."""
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.app.train import shard_dtypes

    lay = meshlm.load_layout("zero2")
    for compile_, comms, narrow in [("aot_eager", "graph", False), ("aot_eager", "eager", True),
                                    ("none", "graph", True)]:
        kw = shard_dtypes(TrainConfig(param_dtype="bfloat16", compile=compile_, compile_comms=comms), lay, {"dp": 2})
        assert (kw["param_dtype"] == torch.bfloat16 and kw["grad_dtype"] == torch.float32) == narrow, (compile_, kw)
        assert kw["compute_dtype"] == torch.bfloat16
