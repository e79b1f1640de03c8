"""A placement over several processes (NOTE [staged decoding]): a 6-block Llama from
Hugging Face weights split into one stage per gloo rank, balanced where it fits and with the
last rank streaming blocks from disk where it does not, generates transformers' greedy
tokens; each rank holds only its own blocks' parameters and KV cache, and a forward moves
one hidden state per stage."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

transformers = pytest.importorskip("transformers")

pool2 = dist_pool_fixture(2, timeout_s=60)
LAYERS, NEW = 6, 12
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [200, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from harness.hf_tiny import hf_greedy, tiny_llama

    d = tmp_path_factory.mktemp("llama6")
    m = tiny_llama(layers=LAYERS)
    m.save_pretrained(d, safe_serialization=True)
    return str(d), hf_greedy(m, PROMPTS, NEW, until_eos=False)


def _staged(path, cap, offload_dir):
    import torch.distributed as dist

    from meshlm.interop.hf import model_of
    from meshlm.interop.hf.load import load_hf_local
    from meshlm.infer import KVCache, generate, placement
    from meshlm.infer.stages import Stages

    rank = dist.get_rank()
    pl = placement.place(model_of(path), cap, len(PROMPTS), max(map(len, PROMPTS)) + NEW, devices=2)
    sw = placement.swapper(pl, offload_dir) if rank == 1 and pl.streamed else None
    model = load_hf_local(
        path, after_block=placement.spill(pl, sw) if sw else None, keep=lambda i: pl.owner(i) == rank
    )
    off = placement.stream_blocks(model, pl, sw) if sw else None
    st = Stages(model, pl, rank)
    try:
        tokens = generate(model, PROMPTS, max_new_tokens=NEW)
        broadcasts = st.broadcasts
        cache = KVCache(1, 4)
        cache.begin(torch.ones(1, 4, dtype=torch.bool))
        with torch.no_grad():
            model(torch.ones(1, 4, dtype=torch.long), cache=cache)
        cache.end()
    finally:
        if off is not None:
            off.close()
    real = [i for i, b in enumerate(model.layers) if all(p.device.type == "cpu" for p in b.parameters())]
    return {
        "tokens": tokens, "stages": pl.stages, "streamed": pl.streamed, "broadcasts": broadcasts,
        "kv_layers": sorted(cache._kv), "real_blocks": real, "bytes_in": sw.bytes_in if sw else 0,
        "tier_bytes": pl.tier_bytes,
    }


@pytest.mark.parametrize("cap_mib,streamed", [(1.0, 0), (0.55, 4)])
def test_stages_generate_transformers_tokens(pool2, hf, tmp_path, cap_mib, streamed):
    path, want = hf
    r0, r1 = pool2.run(_staged, path, cap_mib * 2**20, str(tmp_path))
    assert r0["tokens"] == r1["tokens"] == want
    assert len(r0["streamed"]) == streamed
    owned = [r0["stages"][0], r0["stages"][1] + r0["streamed"]]
    if not streamed:
        assert owned == [[0, 1, 2], [3, 4, 5]]  # balanced where it fits
    for rank, r in enumerate((r0, r1)):
        assert r["kv_layers"] == owned[rank]  # each rank caches its own layers only
        assert r["real_blocks"] == owned[rank]  # the others stay on the meta device
        assert r["broadcasts"] == NEW * 2  # each forward: one hidden state per stage
    assert r1["bytes_in"] == (NEW + 1) * r1["tier_bytes"]  # the last rank streams (+1: the forward above)
