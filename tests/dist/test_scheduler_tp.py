"""Continuous batching under ``tp`` on 2 gloo ranks (NOTE [continuous batching] in
meshlm/infer/scheduler.py): rank 0's scheduler takes requests while others decode and
broadcasts each iteration's plan; rank 1 runs the same forwards.  Greedy requests get the
tokens transformers generates for each prompt alone on one device; sampled ones the tokens
one process draws for them alone; both ranks run the same number of forwards, and the KV
slots on each rank hold half the kv heads."""

from __future__ import annotations

import random
import time

import pytest

from harness import dist_pool_fixture

transformers = pytest.importorskip("transformers")

pool2 = dist_pool_fixture(2, timeout_s=60)
NEW = 10


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(2, 30))] for _ in range(9)]


def _sampling(i):
    from meshlm.infer import Sampling

    return Sampling() if i % 3 == 0 else Sampling(temperature=0.9, top_k=30, top_p=0.9, seed=i)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tiny Llama's directory, transformers' greedy tokens of each prompt alone, and a
    plain one-process model's sampled tokens of each prompt alone."""
    from harness.hf_tiny import hf_greedy, tiny_llama
    from meshlm.infer import generate
    from meshlm.interop.hf.load import load_hf_local

    m = tiny_llama(kv_heads=2)
    d = str(tmp_path_factory.mktemp("llama"))
    m.save_pretrained(d, safe_serialization=True)
    plain = load_hf_local(d)
    want = []
    for i, p in enumerate(_prompts()):
        s = _sampling(i)
        if s.greedy:
            want.append(hf_greedy(m, [p], NEW, until_eos=False)[0])
        else:
            want.append(generate(plain, [p], max_new_tokens=NEW, sampling=s)[0])
    return d, want


def _serve(path):
    import torch.distributed as dist

    import meshlm
    from meshlm.infer.scheduler import Request, Scheduler
    from meshlm.infer.step import Runner, follow
    from meshlm.interop.hf import load_hf

    model = load_hf(path, "tp", meshlm.make_mesh("tp=2"))
    if dist.get_rank() > 0:
        runner = Runner(model, 3, 64)
        follow(runner)
        return runner.forwards, runner.cache.nbytes()
    sched = Scheduler(model, max_batch=3, context=64, prefill_chunk=16)
    reqs = [Request(p, NEW, _sampling(i)) for i, p in enumerate(_prompts())]
    for r in reqs:
        sched.submit(r)
        time.sleep(0.005)
    sched.close()
    return [r.tokens for r in reqs], sched.runner.forwards, sched.runner.cache.nbytes()


def test_tp2_scheduler_equals_one_process_alone(pool2, hf):
    path, want = hf
    (tokens, forwards, nbytes), (follower_forwards, follower_nbytes) = pool2.run(_serve, path)
    assert tokens == want
    assert forwards == follower_forwards and forwards < len(want) * NEW
    # 3 slots x 1 of 2 kv heads x 64 positions (one allocation: 64 < the first capacity) x head_dim 8,
    # keys and values, 2 layers, fp32
    assert nbytes == follower_nbytes == 3 * 1 * 64 * 8 * 2 * 2 * 4


pool2_short = dist_pool_fixture(2, timeout_s=3)  # a collective not entered within 3 s fails


def _idle_then_serve(path, heartbeat_s):
    import torch.distributed as dist

    import meshlm
    from meshlm.infer import scheduler
    from meshlm.infer.scheduler import Request, Scheduler
    from meshlm.infer.step import Runner, follow
    from meshlm.interop.hf import load_hf

    model = load_hf(path, "tp", meshlm.make_mesh("tp=2"))
    if dist.get_rank() > 0:
        runner = Runner(model, 2, 64)
        follow(runner)
        return runner.forwards
    scheduler.HEARTBEAT_S = heartbeat_s
    sched = Scheduler(model, max_batch=2, context=64)
    time.sleep(5)  # idle for longer than the process group's timeout
    req = sched.submit(Request([5, 6, 7], 4))
    sched.close()
    return req.tokens


def test_an_idle_scheduler_keeps_the_other_ranks_waiting(pool2_short, hf):
    """Idle for 5 s on a process group of a 3 s timeout: rank 0's empty plans (every 0.5 s
    here) keep rank 1's broadcast from timing out, and a request after the pause is served."""
    from meshlm.infer import generate
    from meshlm.interop.hf.load import load_hf_local

    path, _ = hf
    tokens, forwards = pool2_short.run(_idle_then_serve, path, 0.5)
    assert tokens == generate(load_hf_local(path), [[5, 6, 7]], max_new_tokens=4)[0] and forwards == 4
