"""``meshlm serve``'s limits before anything loads: the context served is the model's own
(GPT-2's ``block_size``; ``config.json``'s ``max_position_embeddings`` or ``n_positions``)
unless ``--context`` is smaller; a larger one, ``--compile`` with the continuous scheduler and
bad counts are refused naming the flag.  tests/dist/test_serve_load.py serves for real."""

from __future__ import annotations

import json

import pytest

from meshlm.app.serve import _check, parser, serve_context
from meshlm.core.errors import ConfigError
from meshlm.models.gpt2 import GPT2, GPT2Config


def _args(*extra):
    return parser().parse_args(["src", *extra])


@pytest.mark.parametrize("key", ["max_position_embeddings", "n_positions"])
def test_context_from_the_config(tmp_path, key):
    (tmp_path / "config.json").write_text(json.dumps({key: 128}))
    assert serve_context(_args(), tmp_path) == 128
    assert serve_context(_args("--context", "64"), tmp_path) == 64
    with pytest.raises(
        ConfigError, match=f"--context 4096 exceeds the model's context of 128 positions \\(config.json {key}\\)"
    ):
        serve_context(_args("--context", "4096"), tmp_path)


def test_context_of_a_gpt2_and_the_default(tmp_path):
    model = GPT2(GPT2Config(vocab=64, block_size=32, embed=16, layers=1, heads=2), seed=1)
    assert serve_context(_args(), tmp_path, model) == 32
    with pytest.raises(ConfigError, match=r"\(model.block_size\)"):
        serve_context(_args("--context", "33"), tmp_path, model)
    assert serve_context(_args(), tmp_path) == 2048  # nothing says: the default
    with pytest.raises(ConfigError, match="--context 1 must be at least 2"):
        serve_context(_args("--context", "1"), tmp_path)


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--compile", "inductor"], "--compile inductor compiles the decode step of --scheduler static"),
        (["--max-batch", "0"], "--max-batch=0 must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens=0 must be at least 1"),
        (["--max-prompts", "0"], "--max-prompts=0 must be at least 1"),
        (["--prefill-chunk", "0"], "--prefill-chunk=0 must be at least 1"),
        (["--request-timeout", "-1"], "--request-timeout=-1.0 must be >= 0"),
    ],
)
def test_bad_flags_are_refused_naming_them(extra, says):
    with pytest.raises(ConfigError, match=None) as e:
        _check(_args(*extra))
    assert says in str(e.value)
    _check(_args("--scheduler", "static", "--compile", "inductor"))  # what --compile is for
