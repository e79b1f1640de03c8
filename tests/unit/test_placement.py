"""Inference placement under a memory limit (NOTE [inference placement]): the measured
bytes equal Llama's formulas, the fewest blocks are streamed that fit the limit, a limit
below what must stay is refused with the bytes needed, and generation with blocks streamed
from disk equals transformers' greedy tokens while each decode step reads every streamed
block once."""

from __future__ import annotations

import pytest

from meshlm.core.errors import ConfigError
from meshlm.infer import generate
from meshlm.infer.placement import MiB, measure, place, spill, stream_blocks, swapper

transformers = pytest.importorskip("transformers")

LAYERS, B, CTX = 6, 3, 40
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [200, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from harness.hf_tiny import tiny_llama

    d = tmp_path_factory.mktemp("llama6")
    m = tiny_llama(layers=LAYERS)
    m.save_pretrained(d, safe_serialization=True)
    return str(d), m


def _meta(d):
    from meshlm.interop.hf import model_of

    return model_of(d)


def test_measured_bytes_are_llamas(hf_dir):
    cfg = _meta(hf_dir[0]).cfg
    hd, f32 = cfg.hd, 4
    block_params, kv, outside, output = measure(_meta(hf_dir[0]), B, CTX)
    attn = cfg.embed * hd * (2 * cfg.heads + 2 * cfg.kv_heads)
    assert block_params == [(attn + 3 * cfg.embed * cfg.mlp + 2 * cfg.embed) * f32] * LAYERS
    assert kv == [2 * B * cfg.kv_heads * CTX * hd * f32] * LAYERS
    assert outside == (2 * cfg.vocab * cfg.embed + cfg.embed) * f32
    # twice the largest tensor of the prefill: the MLP's hidden activation of every position
    # (the logits are the last position's only, cache.last_only)
    # (attention counted by its output, as a fused kernel holds it)
    assert output == 2 * max(B * CTX * cfg.mlp, B * cfg.vocab) * f32


def test_the_fewest_blocks_streamed_that_fit(hf_dir):
    meta = _meta(hf_dir[0])
    seen = set()
    for cap_kib in range(860, 1600, 20):
        pl = place(meta, cap_kib * 1024, B, CTX)
        assert pl.device_bytes <= pl.max_memory
        assert pl.streamed == list(range(LAYERS - len(pl.streamed), LAYERS))  # the last ones
        if pl.streamed:  # one fewer streamed does not fit
            fewer = type(pl)(**{**pl.__dict__, "streamed": pl.streamed[1:], "stages": [pl.resident + pl.streamed[:1]]})
            assert fewer.device_bytes > pl.max_memory
        seen.add(len(pl.streamed))
    # every placement is met on the way, but for streaming 1 or 2 blocks of equal size: the
    # two blocks in flight cost what keeping them resident does
    assert seen == {0, 3, 4, 5, LAYERS}
    with pytest.raises(ConfigError, match=r"needs 0\.\d\d MiB on the device .* raise the limit"):
        place(meta, 0.1 * MiB, B, CTX)


def test_streamed_generation_equals_transformers(hf_dir, tmp_path):
    from meshlm.interop.hf.load import load_hf_local

    d, hf = hf_dir
    pl = place(_meta(d), 0.9 * MiB, B, 7 + 16)
    assert 2 <= len(pl.streamed) < LAYERS
    sw = swapper(pl, str(tmp_path))
    order = []

    def watch(i, blk):  # built onto the tier: a streamed block is out before the next is read
        spill(pl, sw)(i, blk)
        order.append(all(sw.is_out(p) for p in blk.parameters()) == (i in pl.streamed))

    model = load_hf_local(d, after_block=watch)
    assert order == [True] * LAYERS
    off = stream_blocks(model, pl, sw)
    try:
        got = generate(model, PROMPTS, max_new_tokens=16)
        assert sw.bytes_in == 16 * pl.tier_bytes  # every forward (a prefill, 15 steps) reads each once
        streamed = [p for i in pl.streamed for p in model.layers[i].parameters()]
        resident = [p for i in pl.resident for p in model.layers[i].parameters()]
        assert all(p.untyped_storage().nbytes() == 0 for p in streamed)
        assert all(p.untyped_storage().nbytes() > 0 for p in resident)
    finally:
        off.close()
    from harness.hf_tiny import hf_greedy

    assert got == hf_greedy(hf, PROMPTS, 16, until_eos=False)


def test_meshlm_plan_generate_for_a_model_never_built(capsys):
    """`meshlm plan generate llama3_8b` places a model of 8B parameters without memory (meta
    device): its KV cache for 8 rows of 4,096 positions in bf16 is Llama 3's formula."""
    from meshlm.app.cli import main
    from meshlm.models import CONFIGS

    c = CONFIGS["llama3_8b"]
    args = ["plan", "generate", "llama3_8b", "--batch", "8", "--context", "4096", "--dtype", "bfloat16"]
    assert main([*args, "--max-memory-per-device", "12GiB"]) == 0
    out = capsys.readouterr().out
    kv = c.layers * 2 * 8 * 4096 * c.kv_heads * c.hd * 2
    line = next(ln for ln in out.splitlines() if "KV cache" in ln)
    assert float(line.split()[2].replace(",", "")) == kv / MiB
    assert "streamed from disk" in out and "blocks resident" in out
    assert main([*args, "--max-memory-per-device", "4GiB"]) == 1  # less than must stay
    assert "even with every block streamed" in capsys.readouterr().err
