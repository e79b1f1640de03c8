"""meshlm.models.VLM on one device: the Hydra nodes conf/model/vlm*.yaml build the shipped
configs; every parameter has logical axes a layout can plan (the vision blocks' own heads
over tp); image features land at the image tokens in order; a text row's logits ignore its
image and send no gradient to the encoder; the loss ignores -100; decoding with a KV cache
(images in the prefill) equals one forward; bad configs are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import tolerances as tol
from meshlm.core.errors import ConfigError
from meshlm.models import VLM, VLM_CONFIGS, Llama, VLMConfig, vlm_config, vlm_model

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
MESHLM_KEYS = ("name", "init_from")
IMG, P = 256, 16  # vlm_tiny's image token and patches per image


def _model(seed: int = 1) -> VLM:
    return vlm_model(seed=seed).eval()


def _batch(seed: int = 0, rows: int = 3, seq: int = 24):
    """Rows 0 and 2 hold an image (16 image tokens at different offsets), row 1 is text."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, seq), generator=g)
    tokens[0, 2 : 2 + P] = IMG
    tokens[2, 6 : 6 + P] = IMG
    images = torch.randn(rows, 3, 16, 16, generator=g)
    images[1] = 0
    return tokens, images


@pytest.mark.parametrize("name", sorted(VLM_CONFIGS))
def test_conf_node_instantiates_the_shipped_config(name):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = CONF / f"{name}.yaml"
    node = OmegaConf.load(path)
    assert node.name == name and node._target_ == "meshlm.models.vlm_model"
    args = {k: v for k, v in node.items() if k not in MESHLM_KEYS}
    model = instantiate({**args, "_convert_": "all"}, device="meta")
    assert isinstance(model, VLM) and model.cfg == VLM_CONFIGS[name]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    n = sum(p.numel() for p in model.parameters())
    assert n == model.cfg.num_params()
    stated = re.search(r"\(([\d.]+)M parameters\)", path.read_text().splitlines()[0])
    assert stated and float(stated.group(1)) == round(n / 1e6, 1), (stated, n)
    assert VLMConfig(**model.cfg.to_dict()) == model.cfg  # what a checkpoint's meta.json rebuilds


def test_module_tree_and_feature_layers():
    m = VLM(VLM_CONFIGS["vlm_tiny"], device="meta")
    assert [n for n, _ in m.named_children()] == ["vision", "projector", "language"]
    assert isinstance(m.language, Llama)
    assert len(m.vision.layers) == 2  # 3 layers, features after the second (feature_layer=-2)
    assert len(VLM(vlm_config("vlm_tiny", feature_layer=-1), device="meta").vision.layers) == 3
    assert len(VLM(vlm_config("vlm_tiny", feature_layer=1), device="meta").vision.layers) == 1


@pytest.mark.parametrize("layout,mesh", [("fsdp_tp", {"fsdp": 2, "tp": 2}), ("tp", {"tp": 4}), ("fsdp", {"fsdp": 4})])
def test_every_parameter_is_planned(layout, mesh):
    """Every parameter is annotated (plan_params refuses one that is not) and fits the mesh;
    under tp the vision heads and MLP are split like the decoder's, the projector column-
    then row-parallel."""
    import meshlm
    from meshlm.runtime.lowering import plan_params

    m = VLM(VLM_CONFIGS["vlm_tiny"], device="meta")
    plans = plan_params(m, meshlm.load_layout(layout), mesh)
    assert set(plans) == {n for n, _ in m.named_parameters()}
    if "tp" in mesh:
        local = {n: pl.local_shape(pl.compute, mesh) for n, pl in plans.items()}
        assert local["vision.layers.0.attn.wq"][0] == 4 // mesh["tp"]
        assert local["vision.layers.0.mlp.fc1.weight"][0] == 64 // mesh["tp"]
        assert local["projector.linear_1.weight"][0] == 64 // mesh["tp"]
        assert local["projector.linear_2.weight"][1] == 64 // mesh["tp"]


def test_each_part_is_called_as_a_module():
    """A layout scope runs a submodule's forward under its rules through the module's hooks
    (NOTE [scoped layouts] in meshlm/core/scopes.py): each part must be called, not reached into."""
    m = _model()
    calls = []
    for name in ("vision", "projector", "language"):
        m.get_submodule(name).register_forward_pre_hook(lambda mod, args, n=name: calls.append(n))
    tokens, images = _batch()
    with torch.no_grad():
        m(tokens, images=images)
        assert calls == ["vision", "projector", "language"]
        m(tokens)
    assert calls == ["vision", "projector", "language", "language"]


def test_image_features_land_at_the_image_tokens_in_order():
    m = _model()
    tokens, _ = _batch()
    x = torch.zeros(3, 24, 64)
    feats = torch.arange(3 * P, dtype=torch.float32).reshape(3, P, 1).expand(3, P, 64)
    out = m.merge(tokens, x, feats)
    assert torch.equal(out[0, 2 : 2 + P, 0], torch.arange(P, dtype=torch.float32))
    assert torch.equal(out[2, 6 : 6 + P, 0], torch.arange(2 * P, 3 * P, dtype=torch.float32))
    is_img = tokens == IMG
    assert not out[~is_img].any()  # every other position keeps its token embedding (zeros here)


def test_runs_with_and_without_images():
    m = _model()
    tokens, images = _batch()
    with torch.no_grad():
        text, with_img = m(tokens), m(tokens, images=images)
    assert text.shape == with_img.shape == (3, 24, 272)
    assert (text[0] - with_img[0]).abs().max() > 1e-3  # the image reaches its row
    torch.testing.assert_close(with_img[1], text[1], rtol=0, atol=0)  # and no other


def test_text_row_ignores_its_image():
    m = _model()
    tokens, images = _batch()
    noisy = images.clone()
    noisy[1] = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = m(tokens, images=images), m(tokens, images=noisy)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    torch.testing.assert_close(a[[0, 2]], b[[0, 2]], rtol=0, atol=0)
    other = images.clone()
    other[0] = -other[0]
    with torch.no_grad():
        c = m(tokens, images=other)
    assert (c[0] - a[0]).abs().max() > 1e-3 and torch.equal(c[2], a[2])


def test_loss_is_the_mean_over_labels_not_ignored():
    m = _model()
    tokens, images = _batch()
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    labels[tokens == IMG] = -100
    labels[labels == IMG] = -100
    with torch.no_grad():
        logits = m(tokens, images=images)
        loss = m(tokens, labels, images=images)
    keep = labels != -100
    want = F.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(loss, want, rtol=tol.LOSS_RTOL, atol=0)
    assert abs(float(F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten())) - float(want)) > 1e-3


def _grads(m, tokens, images, labels):
    m.zero_grad(set_to_none=True)
    m(tokens, labels, images=images).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def test_gradient_reaches_the_encoder_through_image_rows_only():
    m = vlm_model(seed=1)
    tokens, images = _batch()
    labels = torch.roll(tokens, -1, 1)
    labels[(tokens == IMG) | (labels == IMG)] = -100
    text_only, image_only = labels.clone(), labels.clone()
    text_only[[0, 2]] = -100
    image_only[1] = -100
    g = _grads(m, tokens, images, text_only)
    for n, t in g.items():
        if n.startswith(("vision.", "projector.")):
            assert t is not None and not t.any(), n
    assert g["language.layers.0.attn.wq"].abs().sum() > 0
    g = _grads(m, tokens, images, image_only)
    for n, t in g.items():
        if n.startswith(("vision.", "projector.")):
            assert t.abs().sum() > 0, n


def _feed(model, cache, tokens, **kw):
    cache.begin(torch.ones_like(tokens, dtype=torch.bool))
    out = model(tokens, cache=cache, **kw)
    cache.end()
    return out


def test_cached_decoding_equals_full_forward():
    """Prefill of 22 tokens with the images (every image token in it), then one at a time."""
    from meshlm.infer import KVCache

    m = _model()
    tokens, images = _batch()
    with torch.no_grad():
        full = m(tokens, images=images)
        cache = KVCache(3, 24)
        parts = [_feed(m, cache, tokens[:, :22], images=images)]
        parts += [_feed(m, cache, tokens[:, j : j + 1]) for j in range(22, 24)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=tol.KV_LOGIT_RTOL, atol=tol.KV_LOGIT_ATOL)


def test_generate_text_only():
    from meshlm.infer import generate

    out = generate(_model(), [[1, 2, 3], [4, 5]], max_new_tokens=4)
    assert [len(r) for r in out] == [4, 4]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(image_token=272), r"model.image_token=272 is not a token id of the decoder's vocabulary"),
        (dict(feature_layer=-5), r"model.feature_layer=-5 is outside the 4 hidden states"),
        (dict(image_size=18), r"model.image_size=18 is not divisible by model.patch_size=4"),
        (dict(vision_heads=3), r"model.vision_embed=32 is not divisible by model.vision_heads=3"),
        (dict(projector_act="relu"), r"model.projector_act='relu'"),
        (dict(width=3), r"model.width: meshlm.models.vlm_model takes no argument 'width'"),
        (dict(language={"embd": 64}), r"model.language: model.embd: .* takes no argument 'embd'"),
    ],
)
def test_bad_config_is_named(kw, match):
    with pytest.raises(ConfigError, match=match):
        vlm_model(device="meta", **kw)


def test_wrong_image_shape_is_named():
    tokens, images = _batch()
    with pytest.raises(
        ConfigError, match=r"images of shape \(3, 3, 8, 8\); the model reads \(batch, \*\(3, 16, 16\)\)"
    ):
        _model()(tokens, images=images[:, :, :8, :8])
