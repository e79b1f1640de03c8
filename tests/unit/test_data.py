"""Tokenizer, corpus loading, train/val split and the data-parallel sharded loader."""

from __future__ import annotations

import pytest
import torch

from meshlm.core.errors import ConfigError
from meshlm.data.text import ByteTokenizer, DataConfig, ShardedLoader, TokenDataset, load_text

SEQ = 7  # windows of 8 tokens


def _arange_loader(
    n_tokens: int = 800, global_batch: int = 8, dp_rank: int = 0, dp_size: int = 1, seed: int = 0
) -> ShardedLoader:
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
    shards = [_batches(_arange_loader(global_batch=8, dp_rank=r, dp_size=dp_size), 25) for r in range(dp_size)]
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


# --------------------------------------------------------------------------- beyond bytes
def bpe_dir(path):
    from harness.tokenizer import train_bpe

    return train_bpe(path)


def _corpus(tmp_path):
    from harness.tokenizer import corpus

    return corpus(tmp_path / "corpus.txt")


def test_hf_tokenizer_encodes_the_text(tmp_path):
    from meshlm.data.text import HFTokenizer

    tok = bpe_dir(tmp_path / "tok")
    f = _corpus(tmp_path)
    text = f.read_text(encoding="utf-8")
    ds = TokenDataset.from_config(DataConfig(path=str(f), tokenizer=str(tmp_path / "tok")), seq_len=16)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert torch.cat([ds.train, ds.val]).tolist() == ids
    assert len(ids) < len(text) // 2  # merges: not bytes
    assert ds.vocab_size == tok.get_vocab_size() > 256
    assert HFTokenizer(str(tmp_path / "tok" / "tokenizer.json")).decode(ds.train[:20]) == tok.decode(ids[:20])
    assert "tokenizer.json" in ds.source


def test_auto_tokenizer_is_the_fine_tuned_model_s(tmp_path):
    bpe_dir(tmp_path / "hf_model")
    (tmp_path / "bare").mkdir()
    f = _corpus(tmp_path)
    explicit = TokenDataset.from_config(DataConfig(path=str(f), tokenizer=str(tmp_path / "hf_model")), seq_len=16)
    for init_from in (str(tmp_path / "hf_model"), "hf:" + str(tmp_path / "hf_model")):
        ds = TokenDataset.from_config(DataConfig(path=str(f)), seq_len=16, init_from=init_from)
        assert torch.equal(ds.train, explicit.train) and ds.vocab_size == explicit.vocab_size
    for init_from in (None, str(tmp_path / "bare")):  # no tokenizer.json there: bytes
        ds = TokenDataset.from_config(DataConfig(path=str(f)), seq_len=16, init_from=init_from)
        assert ds.vocab_size == 256 and len(ds.train) + len(ds.val) == len(f.read_bytes())
    ds = TokenDataset.from_config(
        DataConfig(path=str(f), tokenizer="bytes"), seq_len=16, init_from=str(tmp_path / "hf_model")
    )
    assert ds.vocab_size == 256


def test_missing_tokenizer_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*no tokenizer.json there"):
        TokenDataset.from_config(DataConfig(tokenizer=str(tmp_path)), seq_len=16)


def test_text_from_a_directory_or_a_glob(tmp_path):
    (tmp_path / "sub").mkdir()
    for name, text in (("b.txt", "bee"), ("a.txt", "ay"), ("sub/c.txt", "see"), ("notes.md", "not text")):
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert load_text(str(tmp_path)) == "ay\n\nbee\n\nsee"
    assert load_text(str(tmp_path / "*.txt")) == "ay\n\nbee"
    assert load_text(str(tmp_path / "**" / "c.txt")) == "see"
    with pytest.raises(ConfigError, match=r"data.path=.*matches no files"):
        load_text(str(tmp_path / "*.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.path=.*holds no .txt files"):
        load_text(str(tmp_path / "empty"))


def _write_bins(d, train, val):
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=np.uint16).tofile(d / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(d / "val.bin")


def test_token_files_are_read_by_memory_map(tmp_path):
    import numpy as np

    train = (np.arange(5000) * 7919) % 50000  # ids above 32767: uint16, not int16
    _write_bins(tmp_path / "bins", train, np.arange(100))
    ds = TokenDataset.from_config(DataConfig(format="tokens", path=str(tmp_path / "bins")), seq_len=SEQ)
    assert isinstance(ds.train, np.memmap) and ds.vocab_size == int(train.max()) + 1
    assert ds.val.tolist() == list(range(100))
    as_tensor = torch.from_numpy(train.astype(np.int64))
    for dp_rank in range(2):  # the same batches as the same tokens in memory, epoch wrap included
        mm, ref = (ShardedLoader(t, SEQ, 8, dp_rank, 2, seed=3) for t in (ds.train, as_tensor))
        steps = mm.steps_per_epoch + 2
        for (x, y), (rx, ry) in zip(_batches(mm, steps), _batches(ref, steps)):
            assert x.dtype == torch.long and torch.equal(x, rx) and torch.equal(y, ry)
        resumed = ShardedLoader(ds.train, SEQ, 8, dp_rank, 2, seed=3)
        resumed.load_state_dict(mm.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(resumed.next(), ref.next()))


def test_token_file_errors_name_the_key(tmp_path):
    _write_bins(tmp_path / "bins", range(100), range(100))
    (tmp_path / "bins" / "val.bin").unlink()
    with pytest.raises(ConfigError, match=r"data.path=.*has no val.bin"):
        TokenDataset.from_config(DataConfig(format="tokens", path=str(tmp_path / "bins")), seq_len=SEQ)
    with pytest.raises(ConfigError, match=r"holds train.bin: pre-tokenized files need data.format=tokens"):
        TokenDataset.from_config(DataConfig(path=str(tmp_path / "bins")), seq_len=SEQ)
    with pytest.raises(ConfigError, match=r"data.format=tokens .* set data.path=DIR"):
        TokenDataset.from_config(DataConfig(format="tokens"), seq_len=SEQ)
    (tmp_path / "bins" / "val.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"val.bin holds 3 bytes"):
        TokenDataset.from_config(DataConfig(format="tokens", path=str(tmp_path / "bins")), seq_len=SEQ)
    _write_bins(tmp_path / "short", range(100), range(5))
    with pytest.raises(ConfigError, match=r"val.bin holds 5 tokens.*train.seq_len"):
        TokenDataset.from_config(DataConfig(format="tokens", path=str(tmp_path / "short")), seq_len=SEQ)


def test_vocab_mismatch_names_the_model_key(tmp_path):
    _write_bins(tmp_path, [0, 399] * 20, [1] * 20)
    ds = TokenDataset.from_config(DataConfig(format="tokens", path=str(tmp_path)), seq_len=SEQ)
    ds.check_vocab(400, "m")
    ds.check_vocab(None, "m")  # a model without a vocab axis: nothing to check
    with pytest.raises(
        ConfigError,
        match=r"ids up to 399 \(400 ids\) but model m has a vocabulary of 399.*"
        r"model.vocab=400",
    ):
        ds.check_vocab(399, "m")
    TokenDataset.from_config(DataConfig(), seq_len=SEQ).check_vocab(256, "m")
    with pytest.raises(ConfigError, match="model.vocab=256"):
        TokenDataset.from_config(DataConfig(), seq_len=SEQ).check_vocab(255, "m")
