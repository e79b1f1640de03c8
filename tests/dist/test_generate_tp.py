"""Tensor-parallel generation (meshlm/infer/, NOTE [KV cache]): Hugging Face weights loaded
under the `tp` layout on 2 and 4 gloo ranks generate, greedily, the tokens transformers
generates on one device; the KV cache holds 1/tp of one device's bytes on each rank; a
decode step issues exactly the collectives tensor parallelism needs; a layout that would
split the batch, and more ranks than kv heads, are refused naming the key."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

transformers = pytest.importorskip("transformers")

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [200, 3, 4, 5, 6]]
NEW = 24


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Each tiny model's directory and transformers' greedy tokens for PROMPTS (batched,
    left-padded; each row up to its end-of-sequence token)."""
    from harness.hf_tiny import hf_greedy, tiny_gpt2, tiny_llama

    out = {}
    for name, m in (("llama", tiny_llama()), ("gpt2", tiny_gpt2()), ("llama_kv2", tiny_llama(kv_heads=2))):
        d = str(tmp_path_factory.mktemp(name))
        m.save_pretrained(d, safe_serialization=True)
        rows, eos = hf_greedy(m, PROMPTS, NEW), m.config.eos_token_id
        out[name] = (d, rows, eos)
    return out


def _generate(path, mesh_shape, eos):
    import meshlm
    from meshlm.interop.hf import load_hf
    from meshlm.infer import generate

    model = load_hf(path, "tp", meshlm.make_mesh(mesh_shape))
    return generate(model, PROMPTS, max_new_tokens=NEW, stop=[eos])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp2_greedy_equals_transformers(pool2, hf, name):
    path, want, eos = hf[name]
    assert pool2.run(_generate, path, "tp=2", eos) == [want, want]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp4_greedy_equals_transformers(pool4, hf, name):
    path, want, eos = hf[name]
    assert pool4.run(_generate, path, "tp=4", eos) == [want] * 4


def _decode_step(path, mesh_shape):
    """Prefill 6 tokens of 2 rows, then count one decode step's collectives."""
    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.interop.hf import load_hf
    from meshlm.infer import KVCache

    mesh = meshlm.make_mesh(mesh_shape)
    model = load_hf(path, "tp", mesh)
    cache = KVCache(2, 16)
    with torch.no_grad():
        cache.begin(torch.ones(2, 6, dtype=torch.bool))
        model(torch.ones(2, 6, dtype=torch.long), cache=cache)
        cache.end()
        cc = CommCounter(mesh)
        with cc:
            cache.begin(torch.ones(2, 1, dtype=torch.bool))
            model(torch.ones(2, 1, dtype=torch.long), cache=cache)[:, -1].full_tensor()
            cache.end()
    counts = {k[0]: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary().items()}
    return counts, cache.nbytes(), model.cfg.to_dict()


@pytest.mark.parametrize("name,mesh,t", [("llama", "tp=4", 4), ("gpt2", "tp=2", 2)])
def test_decode_collectives_and_cache_bytes(pool2, pool4, hf, name, mesh, t):
    """Per decode step and rank: two all-reduces of one position's hidden state per layer
    (attention and MLP outputs) and one for the vocab-parallel embedding's partial sums,
    then one all-gather of the last position's logits; nothing else.  The cache holds
    this rank's kv heads only."""
    pool = pool4 if t == 4 else pool2
    res = pool.run(_decode_step, hf[name][0], mesh)
    counts, nbytes, cfg = res[0]
    b, f32 = 2, 4
    layers, embed, vocab = cfg["layers"], cfg["embed"], cfg["vocab"]
    assert counts == {
        "all_reduce": (2 * layers + 1, (2 * layers + 1) * b * embed * f32),
        "all_gather": (1, b * vocab * f32),
    }
    kv_heads = cfg.get("kv_heads", cfg["heads"])
    head_dim = cfg.get("head_dim") or embed // cfg["heads"]
    one_device = layers * 2 * b * kv_heads * 16 * head_dim * f32  # k and v, 16 positions
    assert all(r[1] * t == one_device for r in res)


def _refused(path, layout, mesh_shape):
    import meshlm
    from meshlm.core.errors import MeshlmError
    from meshlm.interop.hf import load_hf
    from meshlm.infer import generate

    try:
        generate(load_hf(path, layout, meshlm.make_mesh(mesh_shape)), PROMPTS, max_new_tokens=2)
    except MeshlmError as e:
        return str(e)
    return None


def test_refusals(pool2, pool4, hf):
    msg = pool2.run(_refused, hf["llama"][0], "fsdp", "fsdp=2")[0]
    assert "layout 'fsdp' splits the batch over fsdp=2" in msg and "every rank decodes the whole batch" in msg
    msg = pool4.run(_refused, hf["llama_kv2"][0], "tp", "tp=4")[0]
    assert "'kv_heads' (size 2) is not divisible by mesh axis tp (size 4)" in msg and "params.kv_heads" in msg


def _compiled(path, eos):
    import importlib

    import meshlm
    from meshlm.interop.hf import load_hf
    from meshlm.infer import generate

    counters = importlib.import_module("torch._dynamo.utils").counters
    compiled = importlib.import_module("meshlm.infer.compiled")._COMPILED
    model = load_hf(path, "tp", meshlm.make_mesh("tp=2"))
    eager = generate(model, PROMPTS, max_new_tokens=NEW, stop=[eos])
    graphs = []
    for n in (4, NEW):  # from scratch each time: the graphs made must not grow with the steps
        torch._dynamo.reset()
        compiled.clear()
        counters.clear()
        out = generate(model, PROMPTS, max_new_tokens=n, stop=[eos], compile="aot_eager")
        graphs.append(counters["frames"]["total"])  # frames Dynamo compiled, recompiles included
    again = generate(model, PROMPTS, max_new_tokens=NEW, stop=[eos], compile="aot_eager")
    return eager, out, again, graphs, counters["frames"]["total"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_tp_decode_is_traced_once(pool2, hf, name):
    """The decode step compiled (aot_eager) under tp=2: transformers' tokens; the frames
    compiled (the sharded root's input handling breaks the step in pieces) are as many for 4
    steps as for 24, and a second call compiles none (with the root's call count guarded on,
    24 steps compiled 40 frames where 4 compiled 34).  GPT-2 looks up its positions (a plain
    tensor of the cache, of a symbolic batch) in a DTensor table."""
    path, want, eos = hf[name]
    for eager, out, again, graphs, after in pool2.run(_compiled, path, eos):
        assert eager == out == again == want
        assert graphs[0] == graphs[1] == after, graphs
