"""Context parallel on models meshlm did not shape (tests/usermodel/mymodels/cp_models.py:
plain PyTorch, only their parameters' axes added, no ``meshlm.constrain``): GPT-2 with learned
absolute positions and a tied head, and a model with its own rotary table and grouped-query
attention on ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``.  Each trains
under ``fsdp_cp`` on fsdp=2 x cp=2 as plain torch does on one process
(harness.parity.check_training: loss, the gradient each optimizer steps with, parameters;
two SGD steps, one at 2,048 tokens),
ring and all-gather, balanced chunks and not, and at 2,048 tokens: positions are global
(NOTE [balanced chunks] in meshlm/_torch_compat/dtensor_cp.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from harness import dist_pool_fixture
from harness.parity import TokenBatches, assert_parity, check_training

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

LAYOUTS = Path(__file__).resolve().parents[2] / "layouts"

pool4 = dist_pool_fixture(4, timeout_s=180)


class Plain:
    """``build`` for check_training: ``torch.manual_seed(seed); cls(**kw)`` (picklable)."""

    def __init__(self, name: str, **kw):
        self.name, self.kw = name, kw

    def __call__(self, device: str, seed: int):
        import mymodels.cp_models

        torch.manual_seed(seed)
        return getattr(mymodels.cp_models, self.name)(**self.kw)


def _layout(tmp_path: Path, attention: str, balance: bool) -> str:
    data = yaml.safe_load((LAYOUTS / "fsdp_cp.yaml").read_text())
    data["context"] = {"attention": attention, "balance": balance}
    path = tmp_path / f"fsdp_cp_{attention}_{balance}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


CASES = [
    # model, attention, balance, batch, seq
    ("PlainGPT2", "ring", True, 2, 2048),
    ("PlainGPT2", "allgather", False, 4, 32),
    ("RotaryLM", "allgather", True, 2, 64),
    ("RotaryLM", "ring", False, 4, 32),
]


@pytest.mark.parametrize(
    "model,attention,balance,batch,seq", CASES, ids=[f"{m}-{a}-balance{b}-seq{s}" for m, a, b, _, s in CASES]
)
def test_unshaped_model_under_fsdp_cp(pool4, tmp_path, model, attention, balance, batch, seq):
    layout = _layout(tmp_path, attention, balance)
    batches = TokenBatches(vocab=64, batch=batch, seq=seq)
    res = pool4.run(
        check_training,
        layout,
        "fsdp=2,cp=2",
        build=Plain(model),
        batches=batches,
        from_seed=False,
        optims=("sgd",),
        steps=1 if seq >= 2048 else 2,
        grad_accum=1,  # accumulation under cp: tests/dist/test_cp.py
    )
    assert_parity(res)


def _masked_model_error() -> str:
    from mymodels.cp_models import MaskedGPT2

    import meshlm

    mesh = meshlm.make_mesh("fsdp=2,cp=2")
    torch.manual_seed(0)
    model = meshlm.shard(MaskedGPT2(), "fsdp_cp", mesh)
    x = torch.randint(0, 64, (2, 32))
    try:
        model(meshlm.shard_batch(x, "fsdp_cp", mesh), meshlm.shard_batch(x, "fsdp_cp", mesh))
    except meshlm.ConfigError as e:
        return str(e)
    return "no error"


def test_an_explicit_attn_mask_is_refused_naming_the_module(pool4):
    """Attention with an explicit ``attn_mask`` on a sequence split over cp: a ConfigError
    naming the module that called it and what to do (NOTE [cp refusal] in
    meshlm/runtime/cp/refuse.py), on every rank, not a DTensor traceback."""
    for msg in pool4.run(_masked_model_error):
        for part in ("module `MaskedAttention`", "cp_models.py:", "attn_mask", "is_causal=True", "without seq: cp"):
            assert part in msg, msg
