"""data.format=images: the captions.jsonl format and its errors, the generated shapes task,
the rows of image tokens and labels, the data-parallel split, and a few training steps of a
stand-in image-text model through the loop's ``accumulate`` / ``train_step`` / ``evaluate``."""

from __future__ import annotations

import json
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from meshlm.app.config import TrainConfig, from_dict
from meshlm.core.errors import ConfigError
from meshlm.data.config import DataConfig
from meshlm.data.images import IGNORE, ImageSpec, ImageTextDataset, image_spec, open_dataset, read_samples
from meshlm.data.shapes import COLOURS, PLACES, make_shapes, write_shapes
from meshlm.data.text import ShardedLoader
from meshlm.models.node import ModelConfig
from meshlm.train.step import accumulate, evaluate, train_step

SPEC = ImageSpec(image_size=16, patch_size=8, image_token=256)  # P = 4 image tokens
P = SPEC.patches
SEQ = 40


def _png(path, size, colour) -> np.ndarray:
    a = np.zeros((size, size, 3), dtype=np.uint8)
    a[..., :] = colour
    a[: size // 2, : size // 2] = 255 - np.array(colour, dtype=np.uint8)  # not uniform: a resize shows
    Image.fromarray(a).save(path)
    return a


def _captions(d, lines) -> None:
    (d / "captions.jsonl").write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


@pytest.fixture
def small_dir(tmp_path):
    """Two PNGs (one of another size), two rows of images.npz, a text-only line."""
    (tmp_path / "img").mkdir()
    red = _png(tmp_path / "img" / "red.png", 16, (200, 10, 10))
    _png(tmp_path / "img" / "big.png", 32, (10, 200, 10))
    arr = np.stack([np.full((16, 16, 3), 7, np.uint8), np.full((16, 16, 3), 99, np.uint8)])
    np.savez(tmp_path / "images.npz", images=arr)
    _captions(
        tmp_path,
        [
            {"image": "img/red.png", "text": "a red thing"},
            {"image": "img/big.png", "text": "a big one"},
            "",  # blank lines are skipped
            {"image": 1, "text": "row one"},
            {"text": "no picture here"},
            {"image": None, "text": "nor here"},
            {"image": "img/red.png", "text": "the red thing again"},
        ],
    )
    return tmp_path, red, arr


def test_reads_pngs_arrays_and_text_only_samples(small_dir):
    d, red, arr = small_dir
    for path in (d, d / "captions.jsonl"):  # the directory or the file itself
        s = read_samples(path, 16)
        assert [x.text for x in s] == [
            "a red thing", "a big one", "row one", "no picture here", "nor here", "the red thing again",
        ]  # fmt: skip
        assert np.array_equal(s[0].image, red)  # PNG round trip: exact
        assert s[1].image.shape == (16, 16, 3)  # 32x32 resized to image_size
        assert np.array_equal(s[2].image, arr[1])
        assert s[3].image is None and s[4].image is None
        assert s[0].group == s[5].group != s[1].group  # one image, two captions: one group
        assert s[4].where.endswith("captions.jsonl:6")  # line numbers count the blank line


@pytest.mark.parametrize(
    "line,words",
    [
        ({"image": "img/nope.png", "text": "x"}, ["captions.jsonl:2", "nope.png", "does not exist"]),
        ('{"image": "img/red.png", "text": "x"', ["captions.jsonl:2", "not a JSON object"]),
        ({"image": "img/red.png", "text": "x", "imgae": "y"}, ["captions.jsonl:2", "keys image, text"]),
        ({"image": "img/red.png", "caption": "x"}, ["captions.jsonl:2", "text a string"]),
        ({"image": 5, "text": "x"}, ["captions.jsonl:2", "image=5", "images.npz"]),
        ({"image": 1.5, "text": "x"}, ["captions.jsonl:2", "must be a path, an index"]),
        ({"text": ""}, ["captions.jsonl:2", "non-empty text"]),
        ({"image": "notes.txt", "text": "x"}, ["captions.jsonl:2", "notes.txt", "not an image"]),
    ],
    ids=[
        "missing_file",
        "bad_json",
        "unknown_key",
        "no_text",
        "index_out_of_range",
        "bad_image_type",
        "empty_text",
        "not_image",
    ],
)
def test_bad_lines_name_file_and_line(small_dir, line, words):
    d, _, _ = small_dir
    (d / "notes.txt").write_text("hello")
    _captions(d, [{"image": "img/red.png", "text": "ok"}, line])
    with pytest.raises(ConfigError) as e:
        read_samples(d, 16)
    for w in words:
        assert w in str(e.value)


def test_missing_captions_and_arrays_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no captions.jsonl.*python -m meshlm.data.shapes .*data.path=null"):
        read_samples(tmp_path / "absent", 16)
    _captions(tmp_path, [{"image": 0, "text": "x"}])
    with pytest.raises(ConfigError, match="images.npz, which does not exist"):
        read_samples(tmp_path, 16)
    np.savez(tmp_path / "images.npz", images=np.zeros((2, 16, 16), np.uint8))
    with pytest.raises(ConfigError, match=r"must be uint8 \(N, H, W, 3\)"):
        read_samples(tmp_path, 16)


def test_rows_image_tokens_caption_end_padding(small_dir):
    d, red, _ = small_dir
    s = read_samples(d, 16)
    ds = ImageTextDataset.from_samples(s, SPEC, SEQ, val_fraction=0.2, seed=0, source="t")
    x, y, extras = ds.loader("train", SEQ, len(ds.train), 0, 1, seed=0).next()
    imgs = extras["images"]
    assert x.shape == y.shape == (len(ds.train), SEQ) and imgs.shape == (len(ds.train), 3, 16, 16)
    assert x.dtype == y.dtype == torch.long and imgs.dtype == torch.float32
    seen = set()
    for row, lab, img in zip(x, y, imgs):
        n_img = int((row == SPEC.image_token).sum())
        assert n_img in (0, P) and torch.all(row[:n_img] == SPEC.image_token)
        text = bytes(row[n_img:][row[n_img:] != 0].tolist()).decode()
        assert text.endswith("\n")
        seen.add(text[:-1])
        end = n_img + len(text)  # real tokens in the window
        # the label at j is token j+1, from the last image token on; -100 before it and on padding
        first = max(n_img - 1, 0)
        assert torch.all(lab[:first] == IGNORE) and torch.all(lab[end - 1 :] == IGNORE)
        assert torch.equal(lab[first : end - 1], row[first + 1 : end])
        if n_img == 0:
            assert torch.all(img == 0)
        else:
            assert img.min() >= 0 and img.max() <= 1 and img.max() > 0
        if text == "a red thing\n":
            assert torch.equal(img, torch.from_numpy(red).permute(2, 0, 1).float() / 255)
    assert seen <= {"a red thing", "a big one", "row one", "no picture here", "nor here", "the red thing again"}


def test_caption_too_long_names_seq_len(small_dir):
    d, _, _ = small_dir
    _captions(d, [{"image": "img/red.png", "text": "x" * 20}, {"text": "ok"}])
    with pytest.raises(ConfigError, match=r"captions.jsonl:1.*train.seq_len\+1=21.*at least 24"):
        ImageTextDataset.from_samples(read_samples(d, 16), SPEC, 20, 0.5, 0, "t")


def test_split_is_seeded():
    samples = _as_samples(make_shapes(60, 16, seed=1))
    a, b, c = (ImageTextDataset.from_samples(samples, SPEC, SEQ, 0.25, seed, "t") for seed in (0, 0, 1))
    assert torch.equal(a.train.windows, b.train.windows) and torch.equal(a.val.windows, b.val.windows)
    assert (len(a.train), len(a.val)) == (45, 15)
    assert not torch.equal(a.val.windows, c.val.windows)  # another seed, another split


def _as_samples(pairs):
    from meshlm.data.images import Sample

    return [Sample(None if im is None else np.asarray(im), t, f"g{i}", f"s:{i}") for i, (im, t) in enumerate(pairs)]


def test_two_captions_of_one_image_share_a_split(small_dir):
    d, _, _ = small_dir
    for seed in range(6):
        ds = ImageTextDataset.from_samples(read_samples(d, 16), SPEC, SEQ, 0.4, seed, "t")
        texts = {
            name: {bytes(r[r < 256][r[r < 256] != 0].tolist()).decode() for r in split.windows}
            for name, split in (("train", ds.train), ("val", ds.val))
        }
        together = [{"a red thing\n", "the red thing again\n"} <= t for t in texts.values()]
        assert any(together), texts


def test_shapes_task_is_deterministic_and_matches_its_captions(tmp_path):
    a, b = make_shapes(40, 24, seed=3, text_only_fraction=0.25), make_shapes(40, 24, seed=3, text_only_fraction=0.25)
    assert [t for _, t in a] == [t for _, t in b]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for (x, _), (y, _) in zip(a, b) if x is not None)
    assert [t for _, t in make_shapes(40, 24, seed=4)] != [t for _, t in a]
    assert sum(im is None for im, _ in a) == 10
    for im, text in a:
        if im is None:
            assert not any(p in text for p in PLACES.values())
            continue
        assert im.size == (24, 24)
        colour = next(c for c in COLOURS if f" {c} " in text)
        place = next(i for i, p in enumerate(PLACES.values()) if text.endswith(p))
        px = np.asarray(im).astype(int)
        ink = np.abs(px - np.array(COLOURS[colour])).sum(-1) < 60  # pixels of the caption's colour
        assert ink.sum() >= 4, text
        assert int(np.nonzero(ink)[1].mean() * 3 // 24) == place, text  # in the caption's third
    d = write_shapes(tmp_path / "s", 40, 24, seed=3, text_only_fraction=0.25)
    lines = (d / "captions.jsonl").read_text().splitlines()
    assert [json.loads(ln)["text"] for ln in lines] == [t for _, t in a]
    stamp = (d / "captions.jsonl").stat().st_mtime_ns
    assert write_shapes(d, 40, 24, seed=3) == d and (d / "captions.jsonl").stat().st_mtime_ns == stamp  # kept
    got = read_samples(d, 24)
    assert all(np.array_equal(s.image, np.asarray(im)) for s, (im, _) in zip(got, a) if im is not None)


def test_write_shapes_loses_a_race_quietly(tmp_path, monkeypatch):
    """Two processes writing the same task: the one whose rename fails keeps the other's."""
    import os

    import meshlm.data.shapes as shapes

    real = os.rename
    write_shapes(tmp_path / "other", 6, 16, seed=0)  # the other process's copy

    def other_process_first(src, dst):
        real(tmp_path / "other", dst)  # it finishes first: dst is taken, the rename below fails
        real(src, dst)

    monkeypatch.setattr(shapes.os, "rename", other_process_first)
    d = write_shapes(tmp_path / "s", 6, 16, seed=0)
    monkeypatch.setattr(shapes.os, "rename", real)
    assert len(read_samples(d, 16)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temporary directory left


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_take_their_rows_of_the_global_batch_like_the_text_loader(dp_size):
    pairs = make_shapes(80, 16, seed=0)
    ds = ImageTextDataset.from_samples(_as_samples(pairs), SPEC, SEQ, 0.1, 0, "t")
    n = len(ds.train)
    ref = ds.loader("train", SEQ, 8, 0, 1, seed=5)
    text = ShardedLoader(ds.train.windows.reshape(-1), SEQ, 8, 0, 1, seed=5)  # same windows as text
    ranks = [ds.loader("train", SEQ, 8, r, dp_size, seed=5) for r in range(dp_size)]
    for _ in range(2 * n // 8 + 1):  # crosses epochs
        x, y, e = ref.next()
        assert torch.equal(x, text.next()[0])
        parts = [r.next() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(torch.cat([p[2]["images"] for p in parts]), e["images"])
    assert ranks[0].state_dict() == ref.state_dict()


def test_loader_too_few_samples_names_the_split():
    ds = ImageTextDataset.from_samples(_as_samples(make_shapes(20, 16)), SPEC, SEQ, 0.1, 0, "t")
    with pytest.raises(ConfigError, match=r"the val split holds 2 samples.*data.val_fraction"):
        ds.loader("val", SEQ, 4, 0, 1, 0)


@pytest.mark.parametrize(
    "data,train,words",
    [
        ({"image_token": 10}, {}, ["data.image_token=10", "byte id", ">= 256"]),
        ({"image_size": 30, "patch_size": 8}, {}, ["data.image_size=30", "data.patch_size=8", "tile"]),
        ({"image_size": 32, "patch_size": 4}, {"seq_len": 64}, ["train.seq_len=64", "64 image tokens", ">= 65"]),
        ({"tokenizer": "/tok.json"}, {}, ["data.tokenizer", "UTF-8 bytes"]),
        ({"val_fraction": 0.0}, {}, ["data.val_fraction=0.0"]),
        ({"shapes_text_only": 1.0}, {}, ["data.shapes_text_only=1.0"]),
        ({"patch_size": 0}, {}, ["data.patch_size=0", ">= 1"]),
    ],
)
def test_config_errors_name_the_key(data, train, words):
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"format": "images", **data}, "train": train})
    for w in words:
        assert w in str(e.value)
    from_dict({"data": {"format": "text", **{k: v for k, v in data.items() if k == "image_token"}}})  # text: unused


class StandIn(nn.Module):
    """An image-text model in miniature: token embedding plus a projection of each image's mean
    colour, a linear head; records the images it is given."""

    param_axes: ClassVar = {"wte": ("vocab", "embed"), "proj": (None, "embed"), "head": ("vocab", "embed")}
    input_axes: ClassVar = {"images": ("batch", None, None, None)}

    def __init__(self, vocab: int = 257, width: int = 48, image_size: int = 16, patch_size: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wte = nn.Parameter(torch.randn(vocab, width, generator=g) * 0.1)
        self.proj = nn.Parameter(torch.randn(3, width, generator=g) * 0.1)
        self.head = nn.Parameter(torch.randn(vocab, width, generator=g) * 0.1)
        self.seen: list[torch.Tensor] = []

    def forward(self, tokens, labels, images):
        self.seen.append(images)
        h = self.wte[tokens] + (images.mean(dim=(2, 3)) * 4 @ self.proj)[:, None, :]
        return F.cross_entropy((h @ self.head.T).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def _text_model(vocab: int = 256, width: int = 32):
    """A model node's target that takes no image settings."""


def test_image_settings_come_from_the_model_and_must_agree_with_it():
    images = DataConfig(format="images")
    m = ModelConfig(target=f"{__name__}.StandIn", args={"patch_size": 4})  # its config over its signature
    assert image_spec(images, m, SEQ) == ImageSpec(16, 4, 256)
    assert image_spec(DataConfig(format="images", image_token=300), m, SEQ).image_token == 300
    with pytest.raises(ConfigError, match=r"data.patch_size=8 but model.patch_size=4: they must agree"):
        image_spec(DataConfig(format="images", patch_size=8), m, SEQ)
    text = ModelConfig(target=f"{__name__}._text_model", name="t")
    with pytest.raises(ConfigError, match=r"data.image_size is null and model t has no image_size argument"):
        image_spec(images, text, SEQ)
    assert image_spec(DataConfig(format="images", image_size=8, patch_size=4), text, SEQ) == ImageSpec(8, 4, 256)
    with pytest.raises(ConfigError, match=r"train.seq_len=10 leaves no room"):
        image_spec(images, m, 10)


def test_training_steps_feed_the_images_and_the_loss_falls(tmp_path):
    cfg = DataConfig(format="images", val_fraction=0.1, shapes_samples=400)
    t = TrainConfig(batch_size=16, seq_len=SEQ, grad_accum=2, grad_clip=0.0)
    mcfg = ModelConfig(target=f"{__name__}.StandIn", name="standin")
    spec = image_spec(cfg, mcfg, SEQ)  # image_size and patch_size from the model's signature
    assert spec == ImageSpec(16, 8, 256)
    ds = open_dataset(cfg, SEQ, mcfg, tmp_path)
    assert (tmp_path / "data").is_dir() and "shapes task" in ds.source
    ds.check_vocab(257, "standin")
    with pytest.raises(ConfigError, match=r"data.image_token=256.*model.vocab=257"):
        ds.check_vocab(256, "standin")
    model = StandIn()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    loader, twin = (ds.loader("train", SEQ, 8, 0, 1, cfg.seed) for _ in range(2))
    passes = accumulate(model, loader.next, t, mcfg, torch.device("cpu"), rank=0)

    def val() -> float:
        return evaluate(model, ds.loader("val", SEQ, 8, 0, 1, cfg.seed), 5, mcfg, torch.device("cpu"))

    before = val()
    model.seen.clear()
    losses = [train_step(passes, opt, t, step, 0.05).loss for step in range(1, 81)]
    assert len(model.seen) == 2 * 80  # two micro-batches a step
    assert all(torch.equal(s, twin.next()[2]["images"]) for s in model.seen)  # the loader's images reached it
    after = val()
    assert losses[-1] < 0.5 * losses[0] and after < 0.5 * before, (losses[::8], before, after)
    # it reads the colour word off the images: without them the held-out captions score worse
    blind = evaluate(_Blind(model), ds.loader("val", SEQ, 8, 0, 1, cfg.seed), 5, mcfg, torch.device("cpu"))
    assert blind > after + 0.1, (blind, after)


class _Blind(nn.Module):
    """``model`` given all-zero images."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels, images):
        return self.model(tokens, labels, torch.zeros_like(images))


def test_text_batches_still_call_the_model_with_tokens_and_targets_only():
    calls = []

    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, tokens, targets):
            calls.append((tokens, targets))
            return self.w * (tokens.float().mean() - targets.float().mean()) ** 2

    loader = ShardedLoader(torch.arange(400), 7, 4, 0, 1, 0)
    t = TrainConfig(batch_size=4, seq_len=7, grad_clip=0.0)
    out = train_step(accumulate(TwoArgs(), loader.next, t, ModelConfig(name="m"), "cpu", 0), _NoOpt(), t, 1, 0.1)
    assert out.loss == pytest.approx(1.0) and len(calls) == 1


class _NoOpt:
    def step(self):
        pass

    def zero_grad(self):
        pass
