"""The pipeline cut and schedule choice without a process group: the probe of a forward on
shapes only (NOTE [pipeline cut]), balancing by parameter count, splits by hand, which
stage each parameter and segment of code belongs to, the stage-to-rank mappings, and the
errors for what cannot be pipelined (NOTE [schedules])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm import nn as mnn
from meshlm.core.errors import ConfigError, LayoutError
from meshlm.layout.rules import parse_layout
from meshlm.models import Llama, llama_config
from meshlm.runtime.absent import Absent, absent_like, has_absent
from meshlm.runtime.pipeline import bubble, cut, probe, schedule_spec
from meshlm.runtime.pipeline.cut import stage_ranks
from meshlm.runtime.pipeline.pipe import check_layout

TOK = torch.zeros(2, 8, dtype=torch.long)


def _llama(layers=4, **kw):
    return Llama(llama_config("llama_tiny", layers=layers, **kw), device="meta")


def test_probe_sees_blocks_in_order_and_where_each_parameter_is_used():
    pr = probe(_llama(), (TOK, TOK))
    assert pr.blocks == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert pr.uses["tok_emb"] == {-1}  # before the first block
    assert pr.uses["lm_head"] == {3} and pr.uses["norm.weight"] == {3}  # after the last
    assert pr.inside["layers.2.mlp.w_up"] == "layers.2"
    assert pr.shapes["layers.1"] == (2, 8, 64) and pr.dtypes["layers.1"] == torch.float32
    assert not any(pr.draws.values()) and all(pr.same_shape.values())
    assert not any(pr.tail_draws.values())  # a stage's forward may stop at the next stage's first block


def test_probe_leaves_the_generator_and_sees_dropout_draws():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    pr = probe(_llama(dropout=0.1), (TOK, TOK))
    assert torch.equal(before, torch.get_rng_state())
    assert all(pr.draws.values()) and all(pr.tail_draws.values())


def test_balanced_by_parameter_count_with_pre_and_post_on_the_ends():
    pr = probe(_llama(layers=6), (TOK, TOK))
    c = cut(pr, 3, 3)
    # the embedding and the head weigh about a block each here: the end stages get fewer blocks
    per = [sum(pr.numel[p] for p in ps) for ps in c.params]
    best = max(per)
    for split in ([2, 2, 2], [1, 4, 1], [3, 2, 1], [1, 2, 3]):
        alt = cut(pr, 3, 3, split=split)
        assert max(sum(pr.numel[p] for p in ps) for ps in alt.params) >= best, split
    assert sum(len(s) for s in c.stages) == 6 and all(c.stages)
    assert "tok_emb" in c.params[0] and "lm_head" in c.params[-1] and "norm.weight" in c.params[-1]
    assert all(p in c.params[c.stage_of_block(b)] for b in pr.blocks for p in pr.inside if pr.inside[p] == b)


def test_split_by_hand_and_its_errors():
    pr = probe(_llama(), (TOK, TOK))
    assert cut(pr, 2, 2, split=[1, 3]).stages == (("layers.0",), ("layers.1", "layers.2", "layers.3"))
    for bad in ([2, 1], [4, 0], [1, 1, 2]):
        with pytest.raises(ConfigError, match=r"pipeline.split=.*add up to the model's 4 blocks"):
            cut(pr, 2, 2, split=bad)


def test_more_stages_than_blocks():
    with pytest.raises(ConfigError, match=r"4 stages but the model has 2 blocks.*mesh.pp x pipeline.stages_per_rank"):
        cut(probe(_llama(layers=2), (TOK, TOK)), 4, 2)


def test_a_tied_head_spans_the_first_and_last_stage():
    pr = probe(_llama(tie_embeddings=True), (TOK, TOK))
    with pytest.raises(ConfigError, match=r"parameter `tok_emb` is used by stages \[0, 1\].*tie_embeddings=false"):
        cut(pr, 2, 2)
    assert len(cut(pr, 1, 1).stages) == 1  # one stage: nothing to span


@meshlm.block
class _Twice(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.lin = mnn.Linear(4, 4, axes=("embed", "embed2"), device=device)

    def forward(self, x):
        return self.lin(x)


class _Shared(nn.Module):
    logical_axes = {"embed2": "a second width"}

    def __init__(self, device=None):
        super().__init__()
        self.blk = _Twice(device)

    def forward(self, x):
        return self.blk(self.blk(x)).sum()


class _NoBlocks(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.lin = mnn.Linear(4, 4, axes=("embed", "mlp"), device=device)

    def forward(self, x):
        return F.relu(self.lin(x)).sum()


def test_a_block_called_twice_and_a_model_without_blocks():
    x = torch.zeros(2, 4)
    with pytest.raises(ConfigError, match="block `blk` is called twice"):
        probe(_Shared(device="meta"), (x,))
    with pytest.raises(ConfigError, match="calls no @meshlm.block"):
        probe(_NoBlocks(device="meta"), (x,))


def test_stage_to_rank_mappings():
    assert stage_ranks(4, 2, "loop") == (0, 1, 0, 1)
    assert stage_ranks(4, 2, "v") == (0, 1, 1, 0)
    assert stage_ranks(2, 2, "loop") == (0, 1)
    c = cut(probe(_llama(), (TOK, TOK)), 4, 2, "v")
    assert c.stages_on(0) == [0, 3] and c.stages_on(1) == [1, 2]


@pytest.mark.parametrize(
    "name,v,pp,m,match",
    [
        ("1f1", 1, 2, 4, r"pipeline.schedule='1f1' \(did you mean '1f1b'\?\)"),
        ("zbv", 1, 2, 4, "runs 2 stages per rank"),
        ("interleaved_1f1b", 1, 2, 4, "runs at least 2 stages per rank"),
        ("1f1b", 2, 2, 4, "runs 1 stage per rank"),
        ("1f1b", 1, 4, 2, r"train.grad_accum=2 < mesh.pp=4.*pipeline.schedule=gpipe"),
        ("interleaved_1f1b", 2, 2, 5, "must be a multiple of 2"),
    ],
)
def test_schedule_errors_name_the_keys(name, v, pp, m, match):
    with pytest.raises(ConfigError, match=match):
        schedule_spec(name, v, pp, m)


def test_gpipe_takes_fewer_micro_batches_than_stages():
    assert schedule_spec("gpipe", 1, 4, 2).cls_name == "ScheduleGPipe"


def test_bubble_formulas():
    assert bubble("1f1b", 4, 8) == pytest.approx(3 / 11) == bubble("gpipe", 4, 8)
    assert bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble("interleaved_1f1b", 4, 8, 2) < bubble("1f1b", 4, 8)


def test_pp_splits_only_the_stack_of_blocks():
    with pytest.raises(LayoutError, match=r"params.layers: \['tp'\]"):
        check_layout(parse_layout({"params": {"layers": ["tp", "pp"]}}))
    with pytest.raises(LayoutError, match=r"compute.embed: \['pp'\].*not a tensor dim"):
        check_layout(parse_layout({"compute": {"embed": "pp", "layers": "pp"}}))
    check_layout(meshlm.load_layout("fsdp_tp_pp"))


def test_absent_values_propagate_shapes_and_refuse_data():
    w = absent_like(torch.empty(8, 4))
    y = F.linear(torch.randn(2, 3, 4), w) + 1.0
    assert isinstance(y, Absent) and y.shape == (2, 3, 8) and has_absent({"a": [y]})
    assert isinstance(torch.cat([y, y]), Absent) and not has_absent([torch.ones(1)])
    with pytest.raises(RuntimeError, match="meta"):
        y.sum().item()


def test_layout_show_names_the_pp_rank_of_each_parameter():
    from meshlm.app.show import layout_table

    out = layout_table("llama_tiny", "fsdp_pp", "fsdp=2,pp=2")
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("tok_emb", "lm_head", "layers.1."))}
    assert "pp:rank 0" in rows["tok_emb"] and "pp:rank 1" in rows["lm_head"] and "pp:R" not in out
    assert "parameters per rank (storage): pp rank 0:" in out and "pp rank 1:" in out


def test_zero_bubble_schedules_are_refused_on_torch_2_11(monkeypatch):
    """torch 2.11's zero-bubble schedules compute wrong weight gradients for meshlm's stages
    (its parity tests fail): they are refused there, naming the version and what to use."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    for name, v in (("zero_bubble", 1), ("zbv", 2)):
        with pytest.raises(ConfigError, match=r"needs torch 2.13 or newer \(this is 2.11.0\+cu130\).*interleaved_1f1b"):
            schedule_spec(name, v, 2, 4)
    assert schedule_spec("interleaved_1f1b", 2, 2, 4).name == "interleaved_1f1b"
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert schedule_spec("zbv", 2, 2, 4).name == "zbv"
