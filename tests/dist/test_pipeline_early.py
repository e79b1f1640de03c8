"""Early reduction under a pipeline (NOTE [early reduction] in meshlm/runtime/optim/early.py): with
``Pipeline.attach(opt, early=True)`` each optimizer chunk's reduce-scatter starts in the backward pass that
makes its last gradient, and the gradients and weights after two steps equal those of the
same pipeline reducing at the step, bit for bit (fsdp_pp on fsdp=2 x pp=2, 1F1B over 4
micro-batches).  Fails if a chunk were started before its last micro-batch's gradient."""

from __future__ import annotations

import torch

from harness import dist_pool_fixture

pool4 = dist_pool_fixture(4, timeout_s=120)


def _run(early: bool):
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh
    from harness.recipes import full_many

    cfg = llama_config("llama_tiny")
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab, (8, 33), generator=g)
    x, y = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    full, sub = pipeline_mesh({"fsdp": 2, "pp": 2})
    pipe = build_pipeline(lambda d: Llama(cfg, device=d), "fsdp_pp", full, sub, example=((x[:2], y[:2]), {}),
                          microbatches=4, schedule="1f1b", seed=0)
    opt = ShardedOptimizer(pipe.model, torch.optim.SGD, lr=0.1)
    pipe.attach(opt, early=early)  # early: off by default on a CPU mesh
    lay = meshlm.load_layout("fsdp_pp")
    inputs = [((meshlm.shard_batch(x[i * 2 : (i + 1) * 2], lay, sub), meshlm.shard_batch(y[i * 2 : (i + 1) * 2], lay, sub)), {})
              for i in range(4)]
    rec = {"grads": [], "params": None, "launched": 0}
    for _ in range(2):
        pipe.step(inputs)
        opt.reduce_grads()
        rec["grads"].append({k: v.clone() for k, v in full_many({f: m.grad for f, m in opt.masters().items()}).items()})
        opt.step()
        opt.zero_grad()
    rec["params"] = {k: v.clone() for k, v in full_many(opt.masters()).items()}
    rec["launched"] = opt.early.launched if opt.early is not None else 0
    rec["chunks"] = len(opt.early.chunks) if opt.early is not None else 0
    return rec


def _job():
    return _run(False), _run(True)


def test_early_reduction_equals_reduction_at_the_step(pool4):
    for r, (late, early) in enumerate(pool4.run(_job)):
        assert late["launched"] == 0 and early["launched"] == 2 * early["chunks"] > 0, (r, early["launched"])
        for k in range(2):
            assert sorted(early["grads"][k]) == sorted(late["grads"][k])
            for n, v in late["grads"][k].items():
                assert torch.equal(early["grads"][k][n], v), f"rank {r} step {k + 1}: gradient of {n} differs"
        for n, v in late["params"].items():
            assert torch.equal(early["params"][n], v), f"rank {r}: {n} differs"
