"""``meshlm diff``'s parts on one process: the command's spelling, the recorder on a plain
model (names, order, nothing changed), one recorded step against plain torch, the comparison
of two captures, and the tolerances it adds (meshlm/train/tolerances.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from meshlm.app.diff import split_overrides
from meshlm.core.errors import ConfigError
from meshlm.models import Llama, llama_config
from meshlm.train import tolerances as tol
from meshlm.train.diff import Capture, Record, Recorder, capture_step, compare, format_report
from meshlm.train.diff.step import PlainOptimizer


# --------------------------------------------------------------------------- spelling
def test_overrides_split_into_shared_and_each_side():
    shared, own, hf = split_overrides(
        ["model=llama_tiny", "a.layout=fsdp_tp", "a.mesh=fsdp2_tp2", "b.layout=single", "+b.train.seed=3", "b=hf:/m"]
    )
    assert shared == ["model=llama_tiny"]
    assert own == {"a": ["layout=fsdp_tp", "mesh=fsdp2_tp2"], "b": ["layout=single", "+train.seed=3"]}
    assert hf == {"a": None, "b": "/m"}


@pytest.mark.parametrize(
    "bad,says",
    [
        (["layout"], "is not an override"),
        (["a=fsdp"], "a=hf:PATH"),
        (["a=hf:/x", "b=hf:/y"], "both sides are Hugging Face models"),
    ],
)
def test_overrides_refused_say_what_to_write(bad, says):
    with pytest.raises(ConfigError, match=says):
        split_overrides(bad)


# --------------------------------------------------------------------------- recording
def _tiny(seed: int = 0) -> Llama:
    return Llama(llama_config("llama_tiny"), seed=seed)


def _batch(n: int = 4, seq: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, seq), generator=g), torch.randint(0, 256, (n, seq), generator=g)


def test_recorder_names_what_the_model_constrains_and_changes_nothing():
    model = _tiny()
    x, y = _batch()
    want = model(x, y)
    rec = Recorder(model)
    with rec.watching():
        got = model(x, y)
    assert torch.equal(got, want)  # bit for bit: the observer and the hooks change nothing
    records = rec.records(1)
    keys = [r.key for r in records]
    assert keys[0] == ("constrain", "", "constrain 0")  # the embedding
    assert ("constrain", "layers.0.attn", "constrain 4") in keys  # the attention output
    assert keys.index(("block", "layers.0", "output")) < keys.index(("constrain", "layers.1.attn", "constrain 0"))
    block = next(r for r in records if r.key == ("block", "layers.1", "output"))
    assert block.axes == ("batch", "seq", "embed")  # from the constrain that made it
    # the plain model's own layer 1 output, computed here
    with torch.no_grad():
        h = model.embed_tokens(x)
        h = model.layers[1](model.layers[0](h))
    assert torch.equal(block.value, h)
    with torch.no_grad():  # after watching, nothing is attached any more
        model(x, y)
    assert rec.records(1) == []


def test_micro_batches_put_back_together_along_the_batch_dim():
    model = _tiny()
    x, y = _batch(4)
    rec = Recorder(model)
    with rec.watching(), torch.no_grad():
        model(x[:2], y[:2])
        model(x[2:], y[2:])
    whole = Recorder(model)
    with whole.watching(), torch.no_grad():
        model(x, y)
    a = {r.key: r.value for r in rec.records(2)}
    b = {r.key: r.value for r in whole.records(1)}
    assert a.keys() == b.keys()
    for k in b:  # the same rows, computed two rows at a time: equal up to float32 order
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=float(tol.activation_tol(b[k]).max()))


def test_gradients_in_backward_order():
    model = _tiny()
    rec = Recorder(model)
    with rec.watching():
        model(*_batch())
    order = rec.backward_order([n for n, _ in model.named_parameters()])
    assert order[0] == "lm_head"  # used last in forward
    assert order.index("norm.weight") < order.index("layers.1.mlp.w_down") < order.index("layers.0.mlp.w_down")
    assert order.index("layers.1.mlp.w_down") < order.index("layers.1.attn.wq")


def test_one_recorded_step_is_plain_torchs():
    """``capture_step`` on a plain model with a ``PlainOptimizer`` against the same step in
    plain torch: loss, gradients (two micro-batches, averaged) and the AdamW step, exactly."""
    x, y = _batch(4)
    model, ref = _tiny(), _tiny()
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = PlainOptimizer(model, torch.optim.AdamW(model.parameters(), **hp))
    micro = [((x[:2], y[:2]), {}), ((x[2:], y[2:]), {})]
    cap = capture_step(model, opt, micro, grad_clip=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    losses = [ref(x[:2], y[:2]), ref(x[2:], y[2:])]
    (sum(losses) / 2).backward()
    got = cap.by_key()
    assert float(got[("loss", "", "loss")].value) == pytest.approx(float(sum(losses).detach() / 2), rel=1e-6)
    for n, p in ref.named_parameters():
        module, _, name = n.rpartition(".")
        torch.testing.assert_close(got[("grad", module, name)].value, p.grad, rtol=1e-6, atol=1e-9)
    ref_opt.step()
    for n, p in ref.named_parameters():
        module, _, name = n.rpartition(".")
        torch.testing.assert_close(got[("param", module, name)].value, p.detach(), rtol=1e-6, atol=1e-8)
    assert cap.meta["optimizer"] == "adamw" and cap.meta["grad_accum"] == 2


# --------------------------------------------------------------------------- comparing
def _capture(model_seed: int = 0, perturb=None) -> Capture:
    model = _tiny(model_seed)
    hp = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = PlainOptimizer(model, torch.optim.AdamW(model.parameters(), **hp))
    cap = capture_step(model, opt, [(_batch(), {})], grad_clip=1.0, meta={"layout": "plain", "mesh": "-"})
    if perturb:
        for r in cap.records:
            if perturb(r):
                r.value = r.value * (1 + 1e-3)
    return cap


def test_equal_captures_agree_and_every_kind_is_compared():
    r = compare(_capture(), _capture())
    assert r.agree and r.first is None
    assert {x.kind for x in r.rows} == {"init", "block", "constrain", "loss", "grad", "norm", "param"}
    assert [x.order for x in r.rows] == list(range(len(r.rows)))
    assert "the sides agree" in format_report(r)


def test_the_first_divergence_in_execution_order():
    """Two tensors off by 0.1%: the report names the earlier one in the step, a forward tensor
    before any gradient, whatever order the side listed them in."""
    a = _capture(perturb=lambda r: r.key in {("grad", "", "lm_head"), ("constrain", "layers.1.mlp", "constrain 1")})
    b = _capture()
    a.records.reverse()
    b.records.reverse()
    r = compare(a, b)
    assert (r.first.kind, r.first.where, r.first.tensor) == ("constrain", "layers.1.mlp", "constrain 1")
    assert [x.label() for x in r.diverged] == ["layers.1.mlp constrain 1", "lm_head"]
    assert r.first.ratio > 10 and r.first.rel == pytest.approx(1e-3, rel=1e-3)
    text = format_report(r)
    assert "first divergence, in execution order:" in text and "layers.1.mlp  constrain 1" in text


def test_a_gradient_on_one_side_only_is_a_divergence_a_forward_tensor_a_note():
    a = _capture()
    a.records = [
        x for x in a.records if x.key not in {("grad", "layers.0.attn", "wq"), ("block", "layers.0", "output")}
    ]
    r = compare(a, _capture())
    assert (r.first.kind, r.first.where, r.first.note) == ("grad", "layers.0.attn.wq", "only on side b")
    assert r.only_b == ["block layers.0 output", "grad layers.0.attn.wq"]
    assert len(r.diverged) == 1


def test_other_weights_are_named_at_the_first_weight():
    r = compare(_capture(model_seed=1), _capture())
    assert (r.first.kind, r.first.where) == ("init", "tok_emb")


def test_report_as_data():
    rep = compare(_capture(), _capture()).to_dict(top=3)
    assert rep["agree"] and rep["first"] is None and len(rep["top"]) == 3
    assert rep["compared"] == len(rep["rows"]) and rep["a"]["layout"] == "plain"


# --------------------------------------------------------------------------- the tolerances it adds
def test_clip_coefficient_bound_holds_against_the_coefficient_itself():
    """NOTE [clipped gradient bound]: over norms within the bound of a reference norm, the
    clip coefficient moves by at most Δc (checked on a grid, plain arithmetic)."""
    for max_norm, n, dn in [(1.0, 2.0, 1e-3), (1.0, 0.9995, 1e-3), (1.0, 0.5, 1e-4), (0.0, 3.0, 1e-2)]:
        c, dc = tol.clip_coefficient_bound(max_norm, n, dn)
        for m in torch.linspace(max(n - dn, 0.0), n + dn, 101).tolist():
            cm = 1.0 if max_norm <= 0 else min(1.0, max_norm / (m + 1e-6))
            assert abs(cm - c) <= dc + 1e-15, (max_norm, n, dn, m)


def test_first_adamw_step_moves_a_weight_by_at_most_lr_whatever_the_gradient():
    """NOTE [first step of AdamW]: from equal weights, two first steps with any gradients end
    within 2 lr (plain torch AdamW)."""
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    w0 = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ends = []
    for seed in (1, 2):
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([w], **hp)
        w.grad = torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 10.0**seed
        opt.step()
        ends.append(w.detach())
    d = (ends[0] - ends[1]).abs()
    bound = tol.first_update_cap("adamw", hp) + tol.step_rounding(w0, ends[0], torch.full_like(w0, hp["lr"]))
    assert bool((d <= bound).all()) and float(d.max()) > hp["lr"]  # reached: the bound is not loose
    assert math.isinf(tol.first_update_cap("sgd", {"lr": 1.0}))


def test_activation_tolerance_covers_a_split_contraction():
    """NOTE [activation tolerance]: a matmul whose contraction is split in two and summed
    (tensor parallelism) against the whole, in float32, is within the bound; a 1e-3 error is not."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=g), torch.randn(128, 256, generator=g)
    whole = x @ w
    split = x[:, :64] @ w[:64] + x[:, 64:] @ w[64:]
    t = tol.activation_tol(whole)
    assert tol.ratio(split - whole, t) <= 1.0
    assert tol.ratio(whole * 1e-3, t) > 1.0


def test_bf16_side_needs_a_calibration():
    a = _capture()
    a.meta["compute_dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="no calibration was given; measure the bf16 rounding"):
        compare(a, _capture())


def test_a_plain_model_copy_is_what_a_record_holds():
    """A recorded parameter is a copy: the step changing the weights in place leaves the
    ``init`` records as they were."""
    model = _tiny()
    before = copy.deepcopy(dict(model.named_parameters()))
    cap = _capture()
    for r in cap.records:
        if r.kind == "init":
            assert torch.equal(r.value, before[r.where].detach())


def test_records_survive_a_file():
    cap = _capture()
    back = Capture.from_state(cap.to_state())
    assert [r.key for r in back.records] == [r.key for r in cap.records]
    assert all(isinstance(r, Record) and torch.equal(r.value, s.value) for r, s in zip(back.records, cap.records))
