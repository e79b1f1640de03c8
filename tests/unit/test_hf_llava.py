"""Hugging Face LLaVA -> meshlm VLM (meshlm/interop/hf/llava.py): a tiny random
LlavaForConditionalGeneration built locally (offline) loads with logits and loss equal to
transformers' (a text-only row in the batch; the default feature layer and the last one with
a tied head); files in the older tensor names load the same; every tensor's block reads as
that block of the whole (what a sharded rank reads); an export loads back in transformers
with the same logits; what meshlm's VLM does not compute is refused naming the key."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness import tolerances as tol
from meshlm.core.errors import ConfigError

transformers = pytest.importorskip("transformers")

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
IMG, P = 256, 16


def _inputs():
    """Rows 0 and 2 hold an image, row 1 is text; HF gets the two images, meshlm a zero third."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 24), generator=g)
    ids[0, 2 : 2 + P] = IMG
    ids[2, 6 : 6 + P] = IMG
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    images = torch.zeros(3, 3, 16, 16)
    images[[0, 2]] = pixels
    return ids, pixels, images


@pytest.fixture(scope="module", params=[(-2, False), (-1, True)], ids=["layer-2", "layer-1-tied"])
def llava(request, tmp_path_factory):
    from harness.hf_tiny import tiny_llava
    from meshlm.interop.hf.load import load_hf_local

    layer, tie = request.param
    d = str(tmp_path_factory.mktemp("llava"))
    hf = tiny_llava(d, feature_layer=layer, tie=tie)
    ids, pixels, images = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels).logits
    return {"hf": hf, "dir": d, "ours": load_hf_local(d), "ref": ref, "tie": tie}


def test_logits_equal_transformers(llava):
    ids, _pixels, images = _inputs()
    with torch.no_grad():
        got = llava["ours"](ids, images=images)
        text = llava["ours"](ids)
    torch.testing.assert_close(got, llava["ref"], **LOGIT_TOL)
    assert (got[0] - text[0]).abs().max() > 0.1  # the image shows in the logits
    assert (llava["ours"].language.lm_head is None) == llava["tie"]


def test_loss_equals_transformers(llava):
    """transformers shifts the labels itself; meshlm's come shifted (-100 where ignored)."""
    ids, pixels, images = _inputs()
    labels = ids.masked_fill(ids == IMG, -100)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    with torch.no_grad():
        want = llava["hf"](input_ids=ids, pixel_values=pixels, labels=labels).loss
        got = llava["ours"](ids, shifted, images=images)
    torch.testing.assert_close(got, want, rtol=tol.HF_LOSS_RTOL, atol=0)


def test_tensor_names_and_skipped_tower_layers(llava):
    from meshlm.interop.hf import llava as hf_llava

    cfg = llava["ours"].cfg
    names = {hf_llava.hf_name(n) for n, _ in llava["ours"].named_parameters()}
    hf_names = set(llava["hf"].state_dict())
    assert names <= hf_names
    skipped = sorted(hf_names - names)
    assert all(hf_llava.is_extra(cfg, n) for n in skipped)
    tower = [n for n in skipped if "vision_tower" in n]
    assert all("post_layernorm" in n or f"layers.{cfg.used_layers}." in n for n in tower), tower
    assert (f"model.vision_tower.encoder.layers.{cfg.used_layers}.mlp.fc1.weight" in tower) == (cfg.used_layers < 3)


def _rewrite(src: str, dst: str, rename) -> None:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh, open(os.path.join(dst, "config.json"), "w") as out:
        out.write(fh.read())


def _older(name: str) -> str:
    """transformers 4.x's file names: the tower under vision_model."""
    return "vision_tower.vision_model." + name[len("vision_tower.") :] if name.startswith("vision_tower.") else name


def _in_memory(name: str) -> str:
    """transformers 5's in-memory names (as a 4.52-4.57 file might hold them)."""
    from meshlm.interop.hf import llava as hf_llava

    return hf_llava.canonical(name).replace("model.vision_tower.", "model.vision_tower.vision_model.")


@pytest.mark.parametrize("rename", [_older, _in_memory], ids=["vision_model", "in_memory"])
def test_other_tensor_names_load_the_same(llava, tmp_path, rename):
    from meshlm.interop.hf.load import load_hf_local

    dst = str(tmp_path / "renamed")
    _rewrite(llava["dir"], dst, rename)
    ids, _pixels, images = _inputs()
    with torch.no_grad():
        got = load_hf_local(dst)(ids, images=images)
    torch.testing.assert_close(got, llava["ref"], **LOGIT_TOL)


def test_blocks_read_as_slices_of_the_whole(llava):
    """Each parameter's block at every half along each dim (a 2-way shard of that dim, as a
    rank of fsdp=2 or tp=2 reads it) equals that block of the whole parameter."""
    from meshlm.interop.hf import llava as hf_llava
    from meshlm.interop.hf.load import _HFReader

    ours = llava["ours"]
    reader = _HFReader(llava["dir"], hf_llava.canonical)
    for fqn, p in ours.named_parameters():
        for d, n in enumerate(p.shape):
            if n % 2:
                continue
            for half in (0, 1):
                box = [(0, k) for k in p.shape]
                box[d] = (half * n // 2, n // 2)
                got = hf_llava.read_block(reader.read, ours.cfg, fqn, tuple(p.shape), box)
                want = p.detach()[tuple(slice(s, s + k) for s, k in box)]
                assert torch.equal(got, want), (fqn, box)


def test_export_loads_in_transformers(llava, tmp_path):
    from meshlm.interop.hf import save_hf

    out = str(tmp_path / "export")
    save_hf(llava["ours"], out)
    back = transformers.LlavaForConditionalGeneration.from_pretrained(out).float().eval()
    ids, pixels, _images = _inputs()
    with torch.no_grad():
        got = back(input_ids=ids, pixel_values=pixels).logits
    torch.testing.assert_close(got, llava["ref"], rtol=0, atol=0)


def _config(llava_dir: str) -> dict:
    with open(os.path.join(llava_dir, "config.json")) as fh:
        return json.load(fh)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("vision_feature_select_strategy", "full", r"vision_feature_select_strategy='full'"),
        ("vision_feature_layer", [-2, -1], r"vision_feature_layer=\[-2, -1\]; meshlm's VLM takes the features of one"),
        ("projector_hidden_act", "gelu_new", r"projector_hidden_act='gelu_new'"),
        ("multimodal_projector_bias", False, r"multimodal_projector_bias=False"),
        ("image_token_index", 300, r"image_token_index=300 is outside text_config.vocab_size=272"),
        ("text_config.model_type", "mistral", r"text_config.model_type='mistral'"),
        ("text_config.attention_bias", True, r"text_config: attention_bias=true"),
        ("vision_config.model_type", "siglip_vision_model", r"vision_config.model_type='siglip_vision_model'"),
        ("vision_config.hidden_act", "gelu", r"vision_config.hidden_act='gelu'"),
        ("vision_config.patch_size", None, r"vision_config.patch_size: missing"),
    ],
)
def test_unsupported_config_is_named(llava, key, value, match):
    from meshlm.interop.hf import llava as hf_llava

    hf = _config(llava["dir"])
    where, _, leaf = key.rpartition(".")
    (hf[where] if where else hf)[leaf] = value
    with pytest.raises(ConfigError, match=match):
        hf_llava.config_from_hf(hf)


def test_directory_of_another_text_model_is_refused(llava, tmp_path):
    from meshlm.interop.hf import read_hf_config

    hf = _config(llava["dir"])
    hf["text_config"]["model_type"] = "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"config.json: text_config.model_type='qwen2'"):
        read_hf_config(str(tmp_path))
