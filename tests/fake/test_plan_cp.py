"""The planner under context parallelism (NOTE [planned cp] in meshlm/plan/cp.py): the
formula's collectives against a counted step on fake 8-rank meshes (the cp attention's
sends, receives and gathers, the gradients' all-reduce over cp, the loss), the measured
planner (one fake step, the cp kernels run on fake tensors) against the formula, and
``layout=auto`` choosing a cp layout only when nothing else fits (NOTE [cp candidates] in
meshlm/plan/search.py)."""

from __future__ import annotations

import io

import pytest

B, S = 8, 32
CASES = {  # name: (layout, 8-rank mesh, activation checkpointing)
    "fsdp_cp": ("fsdp_cp", {"fsdp": 2, "cp": 4}, "none"),
    "fsdp_tp_cp": ("fsdp_tp_cp", {"tp": 2, "cp": 4}, "none"),
    "allgather": ("allgather", {"fsdp": 4, "cp": 2}, "none"),
    "fsdp_cp_full": ("fsdp_cp", {"fsdp": 4, "cp": 2}, "full"),
}
ALLGATHER = """params:
  embed: [dp, fsdp]
compute:
  batch: [dp, fsdp]
  seq: cp
context:
  attention: allgather
  balance: true
"""


@pytest.fixture(scope="module")
def fake8():
    import torch.distributed as dist

    from meshlm.layout.mesh import init_fake

    init_fake(8)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    path = tmp_path_factory.mktemp("layouts") / "fsdp_cp_allgather.yaml"
    path.write_text(ALLGATHER)
    return {"allgather": str(path)}


def _summary(x) -> dict:
    return {k: (int(v["count"]), int(v["bytes"])) for k, v in x.comm_summary(by_phase=True).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_plan_comm_matches_fake_step(fake8, layouts, case):
    """Every collective the formula predicts, by (kind, mesh axis, phase), in count and
    bytes, equals what a counted training step of llama_tiny issues: cp's sends and
    receives (ring) or gathers and reduce-scatters (all-gather), the gradients' all-reduce
    over cp and the loss's, beside the fsdp and tp collectives."""
    from harness.setup import tiny_sharded
    from meshlm.app.train import apply_activation_checkpointing
    from meshlm.plan import plan
    from meshlm.runtime.comm import count_step

    name, mesh_shape, ac = CASES[case]
    layout = layouts.get(name, name)
    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S, fake=True)
    assert apply_activation_checkpointing(model, ac) == (0 if ac == "none" else 2)
    measured = {
        k: (int(v["count"]), int(v["bytes"])) for k, v in count_step(model, opt, x, y, mesh).summary(True).items()
    }
    p = plan("llama_tiny", layout, mesh_shape, global_batch=B, seq=S, activation_checkpointing=ac)
    assert any(k[1] == ("cp",) for k in measured), measured  # the step did exchange over cp
    assert _summary(p) == measured, f"{case}: predicted {_summary(p)}\nmeasured {measured}"


@pytest.mark.parametrize("case", ["fsdp_cp", "fsdp_tp_cp"])
def test_cp_measured_plan_equals_the_formula(fake8, case):
    """The measured planner runs on cp layouts (the cp kernels run on its fake tensors,
    NOTE [cp ops] in meshlm/runtime/cp/ops.py) and equals the formula: model state, the
    held activations (every token term divided by cp, plus the attention output's copy),
    the parameter copies and every collective."""
    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan, plan_model

    name, mesh_shape, ac = CASES[case]
    cfg = llama_config("llama_tiny")
    m = plan_model(lambda device: Llama(cfg, device=device), name, mesh_shape, global_batch=B, seq=S)
    p = plan("llama_tiny", name, mesh_shape, global_batch=B, seq=S)
    for k in ("params", "grads", "optimizer", "gathered", "activations"):
        assert m.memory[k] == p.memory[k], f"{case} {k}: measured {m.memory[k]} formula {p.memory[k]}"
    assert _summary(m) == _summary(p)
    # and the split is real: the same batch with whole sequences holds more per rank
    whole = plan("llama_tiny", "fsdp", {"fsdp": 2}, global_batch=B, seq=S)
    assert p.memory["activations"] < whole.memory["activations"]


def _choose(max_memory: str) -> tuple:
    from meshlm.app.plan import choose_layout

    out = io.StringIO()
    choice = choose_layout(
        model="llama_tiny",
        devices=4,
        max_memory=max_memory,
        global_batch=1,
        seq=4096,
        hardware="cpu",
        planner=None,
        out=out,
    )
    return choice, out.getvalue()


def test_layout_auto_splits_a_long_sequence_over_cp():
    """One 4,096-token sequence on 4 devices: with 15 MiB per device no layout with whole
    sequences fits (the smallest, tp_sp over tp=4, keeps the norms' gathered inputs whole),
    and the search chooses a context-parallel one; with 20 MiB it keeps whole sequences and
    plans no cp layout."""
    from meshlm.plan import search

    smallest = min(c.plan.memory["total"] for c in search.candidates("llama_tiny", 4, global_batch=1, seq=4096))
    assert smallest > 15 * 2**20  # nothing without cp fits 15 MiB
    (layout, mesh), text = _choose("15MiB")
    assert "cp" in mesh and mesh["cp"] > 1 and layout in ("fsdp_cp", "fsdp_tp_cp"), (layout, mesh, text)
    assert "context parallel" in text


def test_layout_auto_keeps_whole_sequences_when_they_fit(monkeypatch):
    from meshlm.plan import search

    asked = []
    real = search.candidates

    def spy(*a, **kw):
        asked.append(kw.get("context", False))
        return real(*a, **kw)

    monkeypatch.setattr(search, "candidates", spy)
    (layout, mesh), text = _choose("20MiB")
    assert "cp" not in mesh and "cp" not in layout, (layout, mesh, text)
    assert asked == [False]  # cp layouts not planned when whole sequences fit
