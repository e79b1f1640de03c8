"""``--compile`` reaches the decode step: ``meshlm generate`` (in process, on a tiny Hugging
Face Llama loaded as plain tensors) and ``meshlm serve --scheduler static``'s decode hand the backend to
``stream``, which asks ``meshlm.infer.compiled.decode_step`` for it; without the flag nothing
is compiled."""

from __future__ import annotations

import io

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from harness.hf_tiny import tiny_llama

    d = tmp_path_factory.mktemp("tiny")
    tiny_llama().save_pretrained(str(d), safe_serialization=True)
    return d


def _spy(monkeypatch) -> list:
    from meshlm.infer import compiled, generate

    gen = __import__("sys").modules[generate.__module__]  # the module, not the function meshlm.infer exports
    asked = []

    def decode_step(model, backend, freeze=None):
        asked.append((type(model).__name__, backend, compiled.why_not_frozen(model, backend)))
        return compiled.decode_step(model, backend, freeze)

    monkeypatch.setattr(gen, "decode_step", decode_step)
    return asked


@pytest.mark.parametrize("flag", [None, "aot_eager"])
def test_generate_cli_passes_compile(model_dir, monkeypatch, flag):
    from meshlm.app.generate import parser, run

    asked = _spy(monkeypatch)
    argv = [str(model_dir), "--prompt", "ab", "--tokenizer", "bytes", "--max-new-tokens", "3"]
    out = io.StringIO()
    assert run(parser().parse_args(argv + (["--compile", flag] if flag else [])), out=out) == 0
    assert out.getvalue().startswith("ab")
    if flag is None:
        assert asked == []
    else:  # one process, single layout: plain tensors (with inductor they would be frozen)
        assert asked == [("Llama", "aot_eager", "compile='aot_eager': only inductor freezes weights")]


def test_serve_decode_passes_compile(model_dir, monkeypatch):
    from meshlm.infer import Sampling, static
    from meshlm.interop.hf.load import load_hf_local

    asked = _spy(monkeypatch)
    model = load_hf_local(str(model_dir))
    steps = list(static.decode(model, ([[1, 2, 3]], 2, Sampling(), ()), "aot_eager"))
    assert len(steps) == 2 and asked == [("Llama", "aot_eager", "compile='aot_eager': only inductor freezes weights")]
    from meshlm.infer.compiled import why_not_frozen

    assert why_not_frozen(model, "inductor") is None  # what --compile inductor would freeze
