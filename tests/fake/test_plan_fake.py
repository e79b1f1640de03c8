"""meshlm.plan against a counted training step on 3-D fake meshes (8 ranks, one process):
the fake process group runs every collective as a no-op with the right shapes, so the
collectives DTensor issues, their mesh axes and their bytes are real while the numbers in
the tensors are not (the fake process group checks layout and shapes, never
numerics).  Extends tests/dist/test_plan_exact.py (2 and 4 gloo ranks) to meshes with dp,
fsdp and tp all present."""

from __future__ import annotations

import pytest

B, S = 8, 8
MESHES = {  # 8 ranks each, every axis a layout uses of size > 1
    "zero1": {"dp": 4, "fsdp": 2},
    "hsdp": {"dp": 4, "fsdp": 2},
    "fsdp_tp_sp": {"dp": 2, "fsdp": 2, "tp": 2},
}


@pytest.fixture(scope="module")
def fake8():
    import torch.distributed as dist

    from meshlm.layout.mesh import init_fake

    init_fake(8)
    yield
    dist.destroy_process_group()


def _check_comm(layout: str, ac: str = "none") -> None:
    """The plan's collectives (kind, axes, phase -> count, bytes) equal a counted step's."""
    from harness.setup import tiny_sharded
    from meshlm.app.train import apply_activation_checkpointing
    from meshlm.plan import plan
    from meshlm.runtime.comm import count_step

    mesh_shape = MESHES[layout]
    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S, fake=True)
    assert apply_activation_checkpointing(model, ac) == (0 if ac == "none" else 2)
    cc = count_step(model, opt, x, y, mesh)
    measured = {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary(by_phase=True).items()}
    p = plan("llama_tiny", layout, mesh_shape, global_batch=B, seq=S, activation_checkpointing=ac)
    predicted = {k: (int(v["count"]), int(v["bytes"])) for k, v in p.comm_summary(by_phase=True).items()}
    assert predicted == measured, f"{layout} {mesh_shape} {ac}: predicted {predicted}\nmeasured {measured}"


@pytest.mark.parametrize("layout", list(MESHES))
def test_plan_comm_matches_fake_step(fake8, layout):
    _check_comm(layout)


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp_sp"])
def test_plan_comm_matches_fake_step_checkpointed(fake8, layout, ac):
    """The same under ``train.activation_checkpointing``: its checkpoint recomputes a
    block's gathers and (early-stopped) tensor-parallel collectives in backward, and the
    lowering nests no re-gathering checkpoint of its own inside it."""
    _check_comm(layout, ac)


@pytest.mark.parametrize(  # every layout and both settings; the 3-D mesh under each
    "layout,ac", [("zero1", "none"), ("hsdp", "full"), ("fsdp_tp_sp", "none"), ("fsdp_tp_sp", "full")]
)
def test_measured_plan_equals_the_llama_formula(fake8, layout, ac):
    """The measured planner (one fake step of the model, NOTE [fake measurement] in
    meshlm/plan/measure.py) against the analytic one for our Llama, where the formula is
    exact (tests/dist/test_plan_exact.py): model state and every collective equal, the held
    parameter copies (NOTE [parameter copies] in meshlm/plan/measure.py) equal the formula's
    gathered weights, and the held activations equal the formula's plus, under a local root (pure data parallelism,
    NOTE [local root] in meshlm/runtime/lowering/local_root.py), the 4-byte loss weight it keeps
    beside the loss and the 4-byte total weight the loss carries for weighting micro-batches
    (NOTE [token weighting] in meshlm/core/weighting.py), which the formula leaves out."""
    from meshlm.layout.rules import load_layout
    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan, plan_model
    from meshlm.runtime.lowering.params import pure_data_parallel

    cfg = llama_config("llama_tiny")
    m = plan_model(
        lambda device: Llama(cfg, device=device),
        layout,
        MESHES[layout],
        global_batch=B,
        seq=S,
        activation_checkpointing=ac,
    )
    p = plan("llama_tiny", layout, MESHES[layout], global_batch=B, seq=S, activation_checkpointing=ac)
    for k in ("params", "grads", "optimizer"):
        assert m.memory[k] == p.memory[k], f"{layout} {k}: measured {m.memory[k]} formula {p.memory[k]}"
    root_weight = 8 if pure_data_parallel(load_layout(layout), MESHES[layout]) else 0
    assert m.memory["gathered"] == p.memory["gathered"], f"{layout} {ac}: {m.memory} vs {p.memory}"
    assert m.memory["activations"] == p.memory["activations"] + root_weight, f"{layout} {ac}: {m.memory} vs {p.memory}"
    held = m.memory["activations"] + m.memory["gathered"]
    assert m.memory["peak"] >= m.memory["params"] + m.memory["optimizer"] + held

    def summary(x):
        return {k: (int(v["count"]), int(v["bytes"])) for k, v in x.comm_summary(by_phase=True).items()}

    assert summary(m) == summary(p)
