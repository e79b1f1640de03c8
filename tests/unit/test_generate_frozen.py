"""The frozen decode step (NOTE [frozen decode] in meshlm/infer/compiled.py): inductor with the
weights frozen into the graph gives eager's tokens, and a frozen step is never run with
weights it did not freeze (another model of the same shapes, the same model after an
in-place update); where the weights cannot be frozen, ``freeze=None`` falls back and
``freeze=True`` says why."""

from __future__ import annotations

import pytest
import torch

from meshlm.core.errors import ConfigError
from meshlm.infer import compiled, generate
from meshlm.models.llama import Llama, LlamaConfig

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9]]


def _llama(seed, layers=2):
    return Llama(LlamaConfig(vocab=256, embed=64, layers=layers, heads=8, kv_heads=2, mlp=96), seed=seed).eval()


def test_frozen_step_follows_the_weights():
    """Three compiled calls in a row: each equals eager's tokens for the weights of the moment,
    though dynamo would happily reuse a frozen graph for them (its guards see the same
    parameter objects after an in-place update)."""
    a, b = _llama(1, layers=1), _llama(2, layers=1)  # one block: each compile costs seconds
    new = 12
    eager_a = generate(a, PROMPTS, max_new_tokens=new)
    assert generate(a, PROMPTS, max_new_tokens=new, compile="inductor") == eager_a
    assert a in compiled._FROZEN  # the frozen path ran
    eager_b = generate(b, PROMPTS, max_new_tokens=new)
    assert eager_b != eager_a
    assert generate(b, PROMPTS, max_new_tokens=new, compile="inductor") == eager_b
    with torch.no_grad():  # an optimizer's step: in place, the same parameter objects
        for p in a.parameters():
            p.mul_(-1.5)
    eager_a2 = generate(a, PROMPTS, max_new_tokens=new)
    assert eager_a2 != eager_a
    assert generate(a, PROMPTS, max_new_tokens=new, compile="inductor") == eager_a2


def test_where_weights_cannot_be_frozen():
    model = _llama(1)
    assert compiled.why_not_frozen(model, "inductor") is None
    assert "only inductor" in compiled.why_not_frozen(model, "aot_eager")
    with pytest.raises(ConfigError, match="freeze=True.*only inductor freezes"):
        generate(model, PROMPTS, max_new_tokens=2, compile="aot_eager", freeze=True)
    with pytest.raises(ConfigError, match="set compile='inductor'"):
        generate(model, PROMPTS, max_new_tokens=2, freeze=True)
    model.layers[1].__dict__["_meshlm_param_offload"] = object()  # what a streamed block carries
    assert "block layers.1 is streamed in" in compiled.why_not_frozen(model, "inductor")
    assert compiled.decode_step(model, "inductor") is compiled.unfrozen("inductor")
    model.layers[1].__dict__.pop("_meshlm_param_offload")
    model._meshlm_state = object()
    assert "sharded" in compiled.why_not_frozen(model, "inductor")
