"""Continuous batching (NOTE [continuous batching] in meshlm/infer/scheduler.py, NOTE [KV
slots] in slots.py) on one process: requests that join and leave a running batch, with slots
reused, get transformers' greedy tokens (each prompt generated alone) and, sampled, the
tokens ``meshlm generate`` draws for them alone; a slot cache's logits equal the plain
model's full forward of each row; a short request ends while a long one decodes; a cancelled
request leaves within one iteration, a timed-out one ends with TimedOut, a stop fails the
rest; slots are reused without moving the cache."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from harness import tolerances as tol
from meshlm.core.errors import ConfigError
from meshlm.infer import Sampling, generate
from meshlm.infer.scheduler import Request, Scheduler, Stopped, TimedOut
from meshlm.infer.slots import SlotCache
from meshlm.models.gpt2 import GPT2, GPT2Config
from meshlm.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

KV_TOL = dict(rtol=tol.KV_LOGIT_RTOL, atol=tol.KV_LOGIT_ATOL)
MODELS = {
    "llama": lambda: Llama(LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=2, mlp=96), seed=1),
    "gpt2": lambda: GPT2(GPT2Config(vocab=256, block_size=128, embed=64, layers=2, heads=4), seed=1),
}


def _prompts(n, seed=0, longest=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


def _staggered(sched, reqs, gap=0.003):
    """Submit ``reqs`` a few milliseconds apart, so that they join a batch already running."""
    for r in reqs:
        sched.submit(r)
        time.sleep(gap)


@pytest.fixture(scope="module")
def hf_llama():
    """A tiny Hugging Face Llama (grouped-query, untied head) and the same weights in meshlm."""
    from harness.hf_tiny import tiny_llama
    from meshlm.interop.hf.load import load_hf_local

    m = tiny_llama(kv_heads=2)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d, safe_serialization=True)
        ours = load_hf_local(d)
    return m, ours


def test_greedy_under_concurrency_equals_transformers_alone(hf_llama):
    """14 prompts (1 to 39 tokens; the longest prefilled in chunks of 16) through 4 slots,
    submitted while others decode: each gets transformers' greedy tokens for it alone, and
    meshlm generate's (the one-request path)."""
    hf, model = hf_llama
    from harness.hf_tiny import hf_greedy

    prompts, new = _prompts(14), 12
    want = [hf_greedy(hf, [p], new, until_eos=False)[0] for p in prompts]
    assert [generate(model, [p], max_new_tokens=new)[0] for p in prompts] == want
    sched = Scheduler(model, max_batch=4, context=128, prefill_chunk=16)
    reqs = [Request(p, new) for p in prompts]
    _staggered(sched, reqs)
    sched.close()
    assert [r.tokens for r in reqs] == want
    assert all(r.finish == "length" for r in reqs)
    assert sched.runner.forwards < sum(len(w) for w in want)  # batched: fewer forwards than tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampled_requests_draw_what_they_draw_alone(name):
    """Requests of different temperatures, top-k, top-p and seeds, and greedy ones, in one
    running batch: each gets the tokens generate draws for its prompt alone with its options."""
    model = MODELS[name]()
    options = [
        Sampling(),
        Sampling(temperature=0.8, seed=3),
        Sampling(temperature=1.3, top_k=20, seed=4),
        Sampling(temperature=0.9, top_p=0.8, seed=5),
        Sampling(temperature=1.0, top_k=40, top_p=0.9, seed=2**63 + 5),
    ]
    prompts = _prompts(10, seed=1, longest=30)
    cases = [(p, options[i % len(options)]) for i, p in enumerate(prompts)]
    want = [generate(model, [p], max_new_tokens=10, sampling=s)[0] for p, s in cases]
    sched = Scheduler(model, max_batch=3, context=64)
    reqs = [Request(p, 10, s) for p, s in cases]
    _staggered(sched, reqs)
    sched.close()
    assert [r.tokens for r in reqs] == want


def test_stop_tokens_and_max_tokens_are_per_request():
    model = MODELS["llama"]()
    p = _prompts(1, seed=2)[0]
    full = generate(model, [p], max_new_tokens=10)[0]
    stop = full[3]
    sched = Scheduler(model, max_batch=2, context=64)
    a, b, c = Request(p, 10, stop=(stop,)), Request(p, 10), Request(p, 2)
    _staggered(sched, [a, b, c])
    sched.close()
    assert a.tokens == full[: full.index(stop) + 1] and a.finish == "stop"
    assert b.tokens == full and b.finish == "length"
    assert c.tokens == full[:2] and c.finish == "length"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_slot_cache_rows_equal_the_full_forward(name):
    """Three slots at different lengths in one forward: a left-padded prefill chunk (slot 2
    fresh, slot 0 after 4 cached tokens), then decode steps of rows of different lengths, in
    the slot order 2, 0, 1 (a gather, not a view): each row's last logits equal the plain
    model's forward over that row's sequence so far."""
    model = MODELS[name]().eval()
    g = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, 256, (n,), generator=g).tolist() for s, n in ((0, 12), (1, 9), (2, 11))}
    cache = SlotCache(4, 32)
    fed = {0: 0, 1: 0, 2: 0}
    seen = []  # (logits of a row, its slot, tokens of that slot fed so far)

    def forward(rows, counts):
        width = max(counts)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (s, n) in enumerate(zip(rows, counts)):
            tokens[b, width - n :] = torch.tensor(seqs[s][fed[s] : fed[s] + n])
            fed[s] += n
        cache.begin(rows, counts, width)
        out = model(tokens, cache=cache)[:, -1]
        cache.end()
        seen.extend((out[b], s, fed[s]) for b, s in enumerate(rows))

    with torch.no_grad():
        forward([0, 1], [4, 6])
        forward([2, 0], [7, 5])
        while any(fed[s] < len(seqs[s]) for s in seqs):
            forward([s for s in (2, 0, 1) if fed[s] < len(seqs[s])], [1] * sum(fed[s] < len(seqs[s]) for s in seqs))
        for got, s, n in seen:
            torch.testing.assert_close(got, model(torch.tensor([seqs[s][:n]]))[0, -1], **KV_TOL)
    assert cache.lengths[:3] == [12, 9, 11] and len(seen) == 14


def test_short_request_ends_while_a_long_one_decodes():
    """Head-of-line blocking: a request of 6 tokens sent while one of 2,000 decodes (with
    other sampling options) ends long before it, in a few iterations."""
    model = Llama(LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=2, mlp=96), seed=1)
    sched = Scheduler(model, max_batch=4, context=4096)
    long = sched.submit(Request([1, 2, 3], 2000))
    while len(long.tokens) < 5:
        time.sleep(0.001)
    short = sched.submit(Request([4, 5, 6], 6, Sampling(temperature=0.7, seed=1)))
    while short.finish is None:
        time.sleep(0.001)
    assert long.finish is None and len(long.tokens) < 200, len(long.tokens)
    sched.stop(10)
    assert long.finish == "stopped"


def test_cancel_leaves_within_one_iteration_and_frees_the_slot():
    """A request cancelled from its third token's callback gets no fourth; its slot serves
    the next request (one slot), whose tokens are its own alone."""
    model = MODELS["llama"]()
    sched = Scheduler(model, max_batch=1, context=512)
    ended = threading.Event()
    a = Request([1, 2, 3], 400, on_end=lambda e: ended.set())
    a.on_token = lambda t: a.cancel() if len(a.tokens) == 3 else None
    sched.submit(a)
    p = _prompts(1, seed=3)[0]
    b = sched.submit(Request(p, 8))
    assert ended.wait(30)
    sched.close()
    assert len(a.tokens) == 3 and a.finish == "cancelled"
    assert b.tokens == generate(model, [p], max_new_tokens=8)[0]


def test_timeout_and_stop():
    model = MODELS["llama"]()
    sched = Scheduler(model, max_batch=2, context=4096)
    errors = []
    t = sched.submit(Request([1, 2], 4000, timeout=0.3, on_end=errors.append))
    while t.finish is None:
        time.sleep(0.01)
    assert t.finish == "timeout" and isinstance(errors[0], TimedOut) and 0 < len(t.tokens) < 4000
    running = sched.submit(Request([1, 2], 4000, on_end=errors.append))
    waiting = [sched.submit(Request([3], 4000, on_end=errors.append)) for _ in range(2)]
    while len(running.tokens) < 2:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert sched.stop(10)
    assert time.monotonic() - t0 < 5
    assert [r.finish for r in [running, *waiting]] == ["stopped"] * 3
    assert all(isinstance(e, Stopped) for e in errors[1:]) and len(errors) == 4
    with pytest.raises(Stopped):
        sched.submit(Request([1], 1))


def test_slots_are_reused_without_moving_the_cache():
    """Nine requests through two slots: the buffers are allocated once (same storage at the
    end as after the first forward) and hold two slots; decode rows of consecutive slots read
    a view of them, no copy."""
    model = MODELS["llama"]()
    sched = Scheduler(model, max_batch=2, context=64)
    first = sched.submit(Request([1, 2, 3], 4))
    while first.finish is None:
        time.sleep(0.01)
    cache = sched.runner.cache
    ptrs = [kv[0].data_ptr() for kv in cache._kv.values()]
    _staggered(sched, [Request(p, 6) for p in _prompts(8, seed=4, longest=20)])
    sched.close()
    assert [kv[0].data_ptr() for kv in cache._kv.values()] == ptrs
    assert all(kv[0].shape[0] == 2 for kv in cache._kv.values())
    cache.lengths = [5, 7]
    cache.begin([0, 1], [1, 1], 1)
    k = torch.randn(2, 2, 1, 8)
    got, _ = cache.update(0, k, k)
    assert got.data_ptr() == cache._kv[0][0].data_ptr()  # a view of the buffer
    cache.end()


def test_bad_requests_are_refused_naming_the_limit():
    model = MODELS["gpt2"]()
    sched = Scheduler(model, max_batch=1, context=32)
    with pytest.raises(ConfigError, match="exceeds the context of 32 tokens"):
        sched.submit(Request([1] * 30, 3))
    with pytest.raises(ConfigError, match="token id 300 is outside the model's vocabulary of 256"):
        sched.submit(Request([300], 3))
    with pytest.raises(ConfigError, match="max_tokens=0"):
        sched.submit(Request([1], 0))
    sched.close()
