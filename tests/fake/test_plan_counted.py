"""A model of many identical blocks is measured on a few and the rest counted (NOTE
[counted blocks] in meshlm/plan/repeats.py): every figure equal to the step measured whole,
for one layout of each kind of sharding and collective the counting must add up, with both
kinds of activation checkpointing, for our Llama and for a GPT-2 that is not meshlm's
(tests/dist/test_nn_models.py).  benchmarks/plan_counted_sweep.py checks every shipped
layout the counting applies to (each a few seconds more, on paths these cover)."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.layout.rules import is_pipelined, load_layout, shipped_layouts

ALL_LAYOUTS = [n for n in shipped_layouts() if not is_pipelined(load_layout(n)) and not load_layout(n).scopes]
#: one per kind: replicated (all-reduce), fully sharded (gathers ahead, reduce-scatter), the
#: optimizer state and the gradients sharded, fsdp with tp (activations all-reduced) and cp,
#: fsdp with tp and ep; sequence parallelism is fsdp_tp_sp's, checkpointed, below.  The others
#: combine these terms (hsdp: ddp's and fsdp's; fsdp_tp: fsdp_tp_cp's and fsdp_tp_ep's without
#: cp or ep, the GPT-2's below; tp, tp_sp: fsdp_tp's, fsdp_tp_sp's without fsdp; fsdp_cp,
#: fsdp_ep: fsdp_tp_cp's, fsdp_tp_ep's without tp; single: none).
LAYOUTS = ["ddp", "fsdp", "zero1", "zero2", "fsdp_tp_cp", "fsdp_tp_ep"]
MESH = {"dp": 2, "fsdp": 2, "tp": 2}
#: four blocks, counted from the first two and three (MIN_BLOCKS lowered to four for the
#: test): two blocks extrapolated, as a 32-block model's 30 are; measured whole, four
B, S, LAYERS = 8, 16, 4


def _mesh(layout: str) -> dict:
    used = load_layout(layout).mesh_axes_used()
    return {a: n for a, n in MESH.items() if a in used} or {"dp": 1}


def _llama(device):
    from meshlm.models import Llama, llama_config

    return Llama(dataclasses.replace(llama_config("llama_tiny"), layers=LAYERS), device=device)


def _gpt2(device):
    from test_nn_models import GPT, GPTConfig

    return GPT(GPTConfig(layers=LAYERS), device=device)


def _both(build, layout, ac, monkeypatch):
    """The plan's figures with the blocks counted, and with the same model measured whole."""
    from meshlm.plan import plan_model, repeats

    def one():
        p = plan_model(build, layout, _mesh(layout), global_batch=B, seq=S, activation_checkpointing=ac)
        return p.memory, p.comm_summary(by_phase=True), p.formulas["flops"], p.formulas["psi"]

    monkeypatch.setattr(repeats, "MIN_BLOCKS", LAYERS)  # counted: 2 and 3 blocks measured
    counted = one()
    monkeypatch.setattr(repeats, "MIN_BLOCKS", LAYERS + 1)  # the same model measured whole
    return counted, one()


def test_the_layouts_are_shipped_ones_the_counting_applies_to():
    assert set(LAYOUTS) <= set(ALL_LAYOUTS), sorted(set(LAYOUTS) - set(ALL_LAYOUTS))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_counted_blocks_equal_the_whole_step(layout, monkeypatch):
    counted, whole = _both(_llama, layout, "none", monkeypatch)
    assert counted == whole


@pytest.mark.parametrize("ac", ["selective", "full"])
@pytest.mark.parametrize("layout", ["fsdp_tp_sp"])  # fsdp's, tp's and sp's terms, recomputed
def test_counted_blocks_equal_the_whole_step_checkpointed(layout, ac, monkeypatch):
    counted, whole = _both(_llama, layout, ac, monkeypatch)
    assert counted == whole


@pytest.mark.parametrize("layout", ["fsdp_tp"])  # the layouts' terms are the Llama's above
def test_counted_blocks_of_a_gpt2(layout, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    counted, whole = _both(_gpt2, layout, "none", monkeypatch)
    assert counted == whole


def test_which_lists_are_counted():
    """Lists of at least MIN_BLOCKS identical blocks; not one whose blocks share a module."""
    import torch

    import meshlm
    from meshlm.plan.repeats import MIN_BLOCKS, repeats

    @meshlm.block
    class Blk(torch.nn.Module):
        def __init__(self, lin=None):
            super().__init__()
            self.lin = lin or torch.nn.Linear(4, 4)

    shared = torch.nn.Linear(4, 4)
    m = torch.nn.Module()
    m.a = torch.nn.ModuleList(Blk() for _ in range(MIN_BLOCKS))
    m.b = torch.nn.ModuleList(Blk() for _ in range(MIN_BLOCKS - 1))
    m.c = torch.nn.ModuleList(Blk(shared) for _ in range(MIN_BLOCKS))
    m.d = torch.nn.ModuleList([*(Blk() for _ in range(MIN_BLOCKS - 1)), Blk(torch.nn.Linear(4, 8))])
    assert [(r.path, r.n) for r in repeats(m)] == [("a", MIN_BLOCKS)]
