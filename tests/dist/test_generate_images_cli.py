"""`meshlm generate --image` as a user runs it, on a tiny random Hugging Face LLaVA made
locally: its greedy continuation of an image and a prompt is transformers' own, token for
token, on one process (this one: through the command's entry point) and tensor parallel
over 2 workers; bad --image input exits non-zero with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from PIL import Image

from harness.cli_here import cli_here

transformers = pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from harness.hf_tiny import tiny_llava
    from meshlm.data.text import ByteTokenizer

    d = tmp_path_factory.mktemp("llava")
    hf = tiny_llava(str(d))
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(16, 16, 3, generator=g) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(d / "img.png")
    images = pixels.permute(2, 0, 1).float()[None] / 255.0  # as meshlm reads a PNG: RGB in [0, 1]
    prompt = "a b"
    ids = torch.tensor([[256] * 16 + list(prompt.encode())])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, pixel_values=images, attention_mask=torch.ones_like(ids),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return d, prompt, prompt + ByteTokenizer().decode(out[0, ids.shape[1]:].tolist())


_cli = cli_here


def _meshlm(*args):
    return subprocess.run([sys.executable, "-m", "meshlm.app.cli", "generate", *map(str, args)],
                          capture_output=True, text=True, timeout=240)


def test_image_and_prompt_continue_as_transformers(llava):
    d, prompt, want = llava
    one = _cli("generate", d, "--image", d / "img.png", "--prompt", prompt, "--max-new-tokens", NEW)
    assert one.returncode == 0, one.stderr
    assert one.stdout == want + "\n"
    tp = _meshlm(d, "--image", d / "img.png", "--prompt", prompt, "--max-new-tokens", NEW, "--layout", "tp",
                 "--mesh", "tp=2")
    assert tp.returncode == 0, tp.stderr
    assert tp.stdout == one.stdout


def test_bad_image_input_exits_with_the_reason(llava, tmp_path):
    d, prompt, _ = llava
    r = _meshlm(d, "--image", tmp_path / "missing.png", "--max-new-tokens", 2)  # a real process: the exit status
    assert r.returncode != 0 and "missing.png: image file" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", d, "--image", d / "img.png", "--image", d / "img.png", "--prompt", prompt, "--max-new-tokens", 2)
    assert r.returncode != 0 and "--image given 2 time(s) for 1 prompt(s)" in r.stderr
