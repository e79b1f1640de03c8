"""Tokenizer, corpus loading, train/val split and the data-parallel sharded loader."""

from __future__ import annotations

import pytest
import torch

from meshlm.data import ByteTokenizer, DataConfig, ShardedLoader, TokenDataset, load_text
from meshlm.errors import ConfigError

SEQ = 7  # windows of 8 tokens


def _arange_loader(n_tokens: int = 800, global_batch: int = 8, dp_rank: int = 0,
                   dp_size: int = 1, seed: int = 0) -> ShardedLoader:
    # tokens[i] == i, so inputs[:, 0] is each window's start offset.
    return ShardedLoader(torch.arange(n_tokens), SEQ, global_batch, dp_rank, dp_size, seed)


def _batches(loader: ShardedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next() for _ in range(n)]


def test_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café, Grüße, 日本語, emoji 🚀"
    ids = tok.encode(text)
    assert ids.dtype == torch.long
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert int(ids.max()) < tok.vocab_size
    assert ids[:2].tolist() == [ord("n"), ord("a")]
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.encode("").tolist() == []


def test_decode_replaces_cut_multibyte_char():
    ids = ByteTokenizer().encode("é")  # two bytes: 0xC3 0xA9
    assert ids.tolist() == [0xC3, 0xA9]
    assert ByteTokenizer().decode(ids[:1]) == "\ufffd"


def test_default_corpus_is_large_english():
    text = load_text(None)
    assert len(text.encode("utf-8")) > 100_000
    for word in (" the ", " and ", " function ", " object "):
        assert text.count(word) > 50, word
    assert load_text(None) == text  # sorted keys: same text every call


def test_split_is_leading_train_trailing_val():
    cfg = DataConfig(val_fraction=0.1)
    ds = TokenDataset.from_config(cfg, seq_len=64)
    all_tokens = ByteTokenizer().encode(load_text(None))
    assert len(ds.train) + len(ds.val) == len(all_tokens)
    assert len(ds.val) == int(len(all_tokens) * 0.1)
    assert torch.equal(torch.cat([ds.train, ds.val]), all_tokens)


def test_reads_utf8_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("héllo wörld " * 100, encoding="utf-8")
    assert load_text(str(f)) == "héllo wörld " * 100
    ds = TokenDataset.from_config(DataConfig(path=str(f), val_fraction=0.25), seq_len=8)
    n = len(("héllo wörld " * 100).encode("utf-8"))
    assert (len(ds.train), len(ds.val)) == (n - n // 4, n // 4)


def test_windows_inputs_labels_shifted_by_one():
    inputs, labels = _arange_loader().next()
    assert inputs.shape == labels.shape == (8, SEQ)
    assert inputs.dtype == labels.dtype == torch.long
    assert torch.equal(labels, inputs + 1)
    assert torch.all(inputs[:, 0] % (SEQ + 1) == 0)  # windows start on window boundaries


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_dp_shards_concatenate_to_global_batch(dp_size):
    ref = _batches(_arange_loader(global_batch=8, dp_size=1), 25)  # 100 windows: crosses epochs
    shards = [_batches(_arange_loader(global_batch=8, dp_rank=r, dp_size=dp_size), 25)
              for r in range(dp_size)]
    for step, (ref_in, ref_lab) in enumerate(ref):
        assert shards[0][step][0].shape == (8 // dp_size, SEQ)
        assert torch.equal(torch.cat([s[step][0] for s in shards]), ref_in)
        assert torch.equal(torch.cat([s[step][1] for s in shards]), ref_lab)


def test_no_window_repeats_within_epoch_and_remainder_dropped():
    loader = _arange_loader(n_tokens=800 + 5, global_batch=8)  # 100 windows, 5 stray tokens
    assert loader.steps_per_epoch == 12  # 96 windows used, 4 dropped
    for epoch in range(3):
        starts = []
        for _ in range(loader.steps_per_epoch):
            assert loader.state_dict()["epoch"] == epoch
            starts += loader.next()[0][:, 0].tolist()
        assert len(starts) == len(set(starts)) == 96
        assert all(s % (SEQ + 1) == 0 and s + SEQ + 1 <= 800 for s in starts)
    assert loader.state_dict() == {"epoch": 3, "step_in_epoch": 0}


def test_epochs_use_different_orders():
    loader = _arange_loader(n_tokens=768)  # 96 windows = 12 full batches: none dropped
    e0 = torch.cat([b[0][:, 0] for b in _batches(loader, loader.steps_per_epoch)])
    e1 = torch.cat([b[0][:, 0] for b in _batches(loader, loader.steps_per_epoch)])
    assert not torch.equal(e0, e1)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(0, 768, SEQ + 1))


def test_same_seed_same_batches_other_seed_differs():
    a = _batches(_arange_loader(seed=3), 20)
    b = _batches(_arange_loader(seed=3), 20)
    c = _batches(_arange_loader(seed=4), 20)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_iter_matches_next():
    it = iter(_arange_loader())
    ref = _batches(_arange_loader(), 15)
    for want in ref:
        got = next(it)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("advance", [5, 11, 12, 30])  # 12 steps per epoch: around the boundary
def test_state_dict_round_trip_continues_identically(advance):
    original = _arange_loader(n_tokens=805, global_batch=8, dp_rank=1, dp_size=2, seed=9)
    _batches(original, advance)
    state = original.state_dict()
    assert state == {"epoch": advance // 12, "step_in_epoch": advance % 12}
    restored = _arange_loader(n_tokens=805, global_batch=8, dp_rank=1, dp_size=2, seed=9)
    restored.load_state_dict(state)
    for want, got in zip(_batches(original, 3), _batches(restored, 3)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_load_state_dict_rejects_state_of_another_setup():
    with pytest.raises(ConfigError, match="train.batch_size"):
        _arange_loader().load_state_dict({"epoch": 0, "step_in_epoch": 99})


def test_missing_file_names_config_key(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match="data.path") as e:
        load_text(str(missing))
    assert str(missing) in str(e.value)


def test_non_utf8_file_names_config_key(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1") * 10)
    with pytest.raises(ConfigError, match="data.path") as e:
        load_text(str(f))
    assert "UTF-8" in str(e.value) and str(f) in str(e.value)


def test_too_short_file_says_bytes_needed(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 500, encoding="utf-8")
    with pytest.raises(ConfigError, match="data.path") as e:
        TokenDataset.from_config(DataConfig(path=str(f), val_fraction=0.05), seq_len=63)
    # val needs int(n * 0.05) >= 64 bytes: n >= 1280.
    assert "500 bytes" in str(e.value) and "at least 1280 bytes" in str(e.value)
    assert str(f) in str(e.value)
    ds = TokenDataset.from_config(DataConfig(path=str(f), val_fraction=0.05), seq_len=23)
    assert len(ds.val) == 25


def test_bad_val_fraction():
    with pytest.raises(ConfigError, match="data.val_fraction"):
        TokenDataset.from_config(DataConfig(val_fraction=0.0), seq_len=8)


def test_indivisible_batch_names_config_key():
    with pytest.raises(ConfigError, match="train.batch_size") as e:
        _arange_loader(global_batch=6, dp_size=4)
    assert "6" in str(e.value) and "dp_size=4" in str(e.value)


def test_too_few_windows_for_one_batch():
    with pytest.raises(ConfigError, match="train.seq_len") as e:
        _arange_loader(n_tokens=8 * 7 + 7, global_batch=8)  # 7 windows < 8
    assert "data.path" in str(e.value) and "train.batch_size" in str(e.value)
