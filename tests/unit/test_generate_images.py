"""Generation from an image (NOTE [image merge] in meshlm/models/vlm.py): the image goes to
the prefill with the prompt's image tokens, and the cached decode then continues as a full
forward over the whole sequence (with the image) would; another image gives another
continuation; bad --image input is a clear error.  The CLI against transformers' LLaVA:
tests/dist/test_generate_images_cli.py."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from meshlm.core.errors import ConfigError
from meshlm.infer.generate import generate
from meshlm.infer.images import image_prompts
from meshlm.models import VLM, Llama, llama_config, vlm_config


def _vlm():
    torch.manual_seed(0)
    m = VLM(vlm_config("vlm_tiny"), seed=3).eval()
    with torch.no_grad():  # image features of order one in the logits
        m.projector.linear_2.weight.mul_(30.0)
    return m


def _full_greedy(model, ids, images, n):
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out]), images=images)
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


def _png(path, colour):
    Image.new("RGB", (20, 12), colour).save(path)  # another size: resized as training does
    return str(path)


def test_cached_generation_with_an_image_equals_full_forwards(tmp_path):
    m = _vlm()
    ids, inputs = image_prompts(m, [_png(tmp_path / "a.png", (200, 30, 30))], [list(b"a ")])
    assert ids[0][:16] == [256] * 16 and ids[0][16:] == list(b"a ")
    assert inputs["images"].shape == (1, 3, 16, 16) and 0.0 <= float(inputs["images"].min())
    got = generate(m, ids, max_new_tokens=6, inputs=inputs)[0]
    assert got == _full_greedy(m, ids[0], inputs["images"], 6)


def test_the_image_matters_and_batches_match_one_by_one(tmp_path):
    m = _vlm()
    paths = [_png(tmp_path / "r.png", (220, 20, 20)), _png(tmp_path / "b.png", (20, 20, 220))]
    ids, inputs = image_prompts(m, paths, [list(b"x"), list(b"the ")])
    both = generate(m, ids, max_new_tokens=5, inputs=inputs)
    alone = [
        generate(m, [ids[i]], max_new_tokens=5, inputs={"images": inputs["images"][i : i + 1]})[0] for i in range(2)
    ]
    assert both == alone  # left padding of the shorter prompt moves its image tokens: still its own image
    first = [
        generate(m, [ids[0]], max_new_tokens=5, inputs={"images": inputs["images"][i : i + 1]})[0] for i in range(2)
    ]
    assert first[0] != first[1], "the continuation does not depend on the image"


def test_bad_image_input(tmp_path):
    m = _vlm()
    png = _png(tmp_path / "a.png", (0, 0, 0))
    with pytest.raises(ConfigError, match="one image per prompt"):
        image_prompts(m, [png, png], [[1]])
    with pytest.raises(ConfigError, match=r"--image .*nope.png: image file .* does not exist"):
        image_prompts(m, [str(tmp_path / "nope.png")], [[1]])
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(ConfigError, match="not an image Pillow can read"):
        image_prompts(m, [str(tmp_path / "bad.png")], [[1]])
    with pytest.raises(ConfigError, match="reads no images"):
        image_prompts(Llama(llama_config("llama_tiny")), [png], [[1]])


def test_memory_limited_placement_refuses_an_encoder_clearly():
    from meshlm.infer.placement import measure

    with pytest.raises(ConfigError, match=r"7 blocks of which 4 decode with a cache.*decoder-only models"):
        measure(VLM(vlm_config("vlm_small"), device="meta"), 1, 32)
