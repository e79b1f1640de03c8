"""Generation on one device (NOTE [KV cache] in meshlm/infer/cache.py): cached decoding
equals a full forward at every position, a left-padded row computes what its prompt alone
would, greedy generation equals transformers' token for token (Llama with grouped-query
attention and an untied head, GPT-2), sampling options do what they say, and bad input is
refused naming the option."""

from __future__ import annotations

import pytest
import torch

from harness import tolerances as tol
from meshlm.core.errors import ConfigError
from meshlm.infer import KVCache, Sampling, generate, stream
from meshlm.infer.sample import choose, filter_logits, generators
from meshlm.models.gpt2 import GPT2, GPT2Config
from meshlm.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

KV_TOL = dict(rtol=tol.KV_LOGIT_RTOL, atol=tol.KV_LOGIT_ATOL)
MODELS = {
    "llama": lambda: Llama(LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=2, mlp=96), seed=1),
    "gpt2": lambda: GPT2(GPT2Config(vocab=256, block_size=64, embed=64, layers=2, heads=4), seed=1),
}


def _feed(model, cache, tokens, valid=None):
    cache.begin(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)
    out = model(tokens, cache=cache)
    cache.end()
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_logits_equal_full_forward(name):
    """Prefill 5, then 3 at once (a chunk after the first: an explicit mask), then one at a
    time: every position's logits equal one forward over all 14 tokens."""
    model = MODELS[name]().eval()
    tokens = torch.randint(0, 256, (3, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(3, 14)
        parts = [_feed(model, cache, tokens[:, :5]), _feed(model, cache, tokens[:, 5:8])]
        parts += [_feed(model, cache, tokens[:, j : j + 1]) for j in range(8, 14)]
    torch.testing.assert_close(torch.cat(parts, 1), full, **KV_TOL)
    assert cache.length == 14


@pytest.mark.parametrize("name", sorted(MODELS))
def test_left_padded_row_equals_its_prompt_alone(name):
    """Row 1 is 4 pad slots then 6 tokens: its logits, in prefill and in two decode steps,
    equal those of its 6 tokens decoded alone (positions count real tokens; pads unseen)."""
    model = MODELS[name]().eval()
    g = torch.Generator().manual_seed(1)
    long, short, nxt = torch.randint(0, 256, (10,), generator=g), torch.randint(0, 256, (6,), generator=g), [7, 9]
    batch = torch.stack([long, torch.cat([torch.full((4,), 99), short])])
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False
    with torch.no_grad():
        c2, c1 = KVCache(2, 12), KVCache(1, 8)
        both = [_feed(model, c2, batch, valid)[1, 4:]]
        alone = [_feed(model, c1, short[None])[0]]
        for t in nxt:
            both.append(_feed(model, c2, torch.tensor([[t], [t]]))[1])
            alone.append(_feed(model, c1, torch.tensor([[t]]))[0])
    torch.testing.assert_close(torch.cat(both), torch.cat(alone), **KV_TOL)


@pytest.fixture(scope="module")
def hf_models():
    from harness.hf_tiny import tiny_gpt2, tiny_llama

    return {"llama": tiny_llama(kv_heads=2), "gpt2": tiny_gpt2()}


def _ours(hf_model, tmp_path):
    from meshlm.interop.hf.load import load_hf_local

    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    return load_hf_local(str(tmp_path))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [200, 3, 4, 5, 6]]


def _hf_greedy(m, prompts, n):
    from harness.hf_tiny import hf_greedy

    return hf_greedy(m, prompts, n)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_equals_transformers(hf_models, tmp_path, name):
    """30 new tokens or up to the end-of-sequence token, each prompt alone and the three
    left-padded in one batch."""
    hf = hf_models[name]
    ours = _ours(hf, tmp_path)
    stop = [hf.config.eos_token_id]
    batched = generate(ours, PROMPTS, max_new_tokens=30, stop=stop)
    assert batched == _hf_greedy(hf, PROMPTS, 30)
    assert sum(map(len, batched)) > 60  # long enough to tell
    for p, row in zip(PROMPTS, batched):
        assert generate(ours, [p], max_new_tokens=30, stop=stop) == [row] == _hf_greedy(hf, [p], 30)


def test_stop_token_ends_its_row_only():
    model = MODELS["llama"]()
    free = generate(model, PROMPTS, max_new_tokens=12)
    stop = free[1][4]  # row 1's fifth token
    got = generate(model, PROMPTS, max_new_tokens=12, stop=[stop])
    for row, want in zip(got, free):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert row == want[:cut]
    assert len(got[1]) <= 5


def test_stream_yields_each_step_as_it_is_made():
    model = MODELS["gpt2"]()
    steps = list(stream(model, PROMPTS, max_new_tokens=6))
    assert len(steps) == 6 and all([i for i, _ in s] == [0, 1, 2] for s in steps)
    assert [[t for _, t in s] for s in steps] == [list(c) for c in zip(*generate(model, PROMPTS, max_new_tokens=6))]


def test_filter_logits_keeps_what_top_k_and_top_p_say():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, Sampling(temperature=1.0, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False]  # 0.5 alone reaches 0.5
    assert kept(top_p=0.6) == [True, True, False, False]
    assert kept(top_p=0.9) == [True, True, True, False]
    assert kept(top_k=3, top_p=0.6) == [True, True, False, False]
    assert kept() == [True] * 4
    t2 = filter_logits(logits, Sampling(temperature=2.0))
    torch.testing.assert_close(t2, logits / 2)


def test_sampling_is_seeded_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3)

    def draw(seed, **kw):
        s = Sampling(temperature=1.0, seed=seed, **kw)
        return choose(logits, s, [torch.Generator().manual_seed(seed + i) for i in range(len(logits))])

    a, b, c = draw(1), draw(1), draw(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)  # 4.6 sigma of 0.7's
    assert set(draw(3, top_k=1).tolist()) == {0}
    model = MODELS["llama"]()
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=5)
    batch = generate(model, PROMPTS, max_new_tokens=8, sampling=s)
    # prompt i draws from stream (seed, i) whatever the batch: alone, given its index, it draws the same
    alone = [generate(model, [p], max_new_tokens=8, sampling=s, rows=[i])[0] for i, p in enumerate(PROMPTS)]
    assert alone == batch
    assert generate(model, PROMPTS, max_new_tokens=8, sampling=s) == generate(
        model, PROMPTS, max_new_tokens=8, sampling=s
    )


@pytest.mark.parametrize(
    "opts,key",
    [
        ({"temprature": 1.0}, "sampling.temprature"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
    ],
)
def test_bad_sampling_options(opts, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Sampling.from_dict(opts)


def test_bad_generate_input():
    gpt2 = MODELS["gpt2"]()  # block_size 64
    with pytest.raises(ConfigError, match="exceeds the model's context of 64"):
        generate(gpt2, [[1] * 60], max_new_tokens=5)
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 256"):
        generate(gpt2, [[1, 256]], max_new_tokens=1)
    with pytest.raises(ConfigError, match="at least one token"):
        generate(gpt2, [[1], []], max_new_tokens=1)

    class NoCache(torch.nn.Module):
        def forward(self, tokens):
            return tokens

    with pytest.raises(ConfigError, match="takes no `cache` argument"):
        generate(NoCache(), [[1]], max_new_tokens=1)
    cache = KVCache(1, 4)
    with pytest.raises(ConfigError, match="more than the cache's max_len=4"):
        cache.begin(torch.ones(1, 5, dtype=torch.bool))


def test_compiled_decode_is_traced_once(monkeypatch):
    """24 decode steps of left-padded prompts compiled (aot_eager): the same tokens as eager,
    one graph (the cache's length a symbol from the first trace, NOTE [compiled decode]),
    and a second call traces nothing."""
    from torch._dynamo.utils import counters

    from meshlm.infer import compiled

    model = MODELS["llama"]()
    eager = generate(model, PROMPTS, max_new_tokens=24)
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_COMPILED", {})
    counters.clear()
    assert generate(model, PROMPTS, max_new_tokens=24, compile="aot_eager") == eager
    assert counters["stats"]["unique_graphs"] == 1
    assert generate(model, PROMPTS, max_new_tokens=24, compile="aot_eager") == eager
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


def test_each_prompt_draws_from_its_own_stream():
    """NOTE [row streams]: one prompt twice in a batch under one seed, sampled at temperature 1
    from a flat distribution, continues differently in each row (one shared stream made the
    rows take the same draws, so different prompts continued nearly alike); each row's
    draws are torch.multinomial's with a generator seeded from (seed, row) alone."""
    from meshlm.infer.sample import row_seed

    model = MODELS["llama"]()
    s = Sampling(temperature=1.0, seed=1)
    a, b = generate(model, [PROMPTS[0], PROMPTS[0]], max_new_tokens=12, sampling=s)
    assert a != b
    assert len({row_seed(1, i) for i in range(1000)} | {row_seed(2, 0)}) == 1001
    logits = torch.zeros(2, 50)
    got = choose(logits, s, generators(s, 2))
    want = [torch.multinomial(torch.full((50,), 0.02), 1, generator=torch.Generator().manual_seed(row_seed(1, i)))
            for i in range(2)]  # fmt: skip
    assert got.tolist() == torch.cat(want).tolist()
