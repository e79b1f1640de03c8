"""meshlm plan of pipelines with expert or context parallelism inside their stages
(NOTE [planning stages] in meshlm/plan/pipeline.py), on a fake process group: what a stage
sends and receives per step is each rank's slice of the hidden state and, for a mixture of
experts, its blocks' side outputs (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py).
Without the side outputs counted, the first test's bytes are short by 16 of 32,784."""

from __future__ import annotations

from meshlm.models import moe_config

B, S = 8, 32


class Build:
    def __call__(self, device):
        from meshlm.models import MoETransformer

        return MoETransformer(moe_config("moe_tiny"), device=device)


def test_planned_stages_send_their_side_outputs():
    """fsdp_ep_pp plans (pp=2 x ep=2): the routing's all-to-all over ep inside the stages,
    and stage 0 sends per micro-batch its ep rank's rows of the hidden state and of its
    block's per-row auxiliary loss (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py),
    and receives their gradients."""
    from meshlm.plan import plan_model

    accum = 2
    c = moe_config("moe_tiny")
    p = plan_model(Build(), "fsdp_ep_pp", {"pp": 2, "ep": 2}, global_batch=B, seq=S, grad_accum=accum)
    assert any(x.kind == "all_to_all" and x.axes == ("ep",) for x in p.comm)
    rows = B // accum // 2  # one block on each stage: one aux loss of (rows,) crosses
    st = p.formulas["stages"][0]
    assert st["send_bytes"] == st["recv_bytes"] == accum * (rows * S * c.embed * 4 + rows * 4)


def test_cp_inside_pipeline_stages_plans():
    """fsdp_cp_pp plans (cp=2 x pp=2): the ring's sends over cp inside the stages, and stage
    0 sends per micro-batch its cp rank's half of the sequence of the hidden state (and
    receives its gradient), never the whole sequence."""
    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan_model

    cfg = llama_config("llama_tiny", layers=4)
    accum = 2
    p = plan_model(
        lambda device: Llama(cfg, device=device),
        "fsdp_cp_pp",
        {"cp": 2, "pp": 2},
        global_batch=B,
        seq=S,
        grad_accum=accum,
    )
    assert any(x.kind == "send" and x.axes == ("cp",) for x in p.comm)
    st = p.formulas["stages"][0]
    assert st["send_bytes"] == st["recv_bytes"] == accum * (B // accum) * (S // 2) * cfg.embed * 4


def test_bad_combinations_name_the_key():
    """What the stages cannot split is refused by name before anything runs: experts that
    ep does not divide (``params.experts``), a sequence that balanced cp chunks do not
    divide (``context.balance``)."""
    import pytest

    from meshlm.core.errors import MeshlmError
    from meshlm.models import Llama, MoETransformer, llama_config
    from meshlm.plan import plan_model

    moe3 = lambda device: MoETransformer(moe_config("moe_tiny", experts=3), device=device)  # noqa: E731
    with pytest.raises(MeshlmError, match=r"'experts' \(size 3\) is not divisible by mesh axis ep.*params\.experts"):
        plan_model(moe3, "fsdp_ep_pp", {"pp": 2, "ep": 2}, global_batch=B, seq=S, grad_accum=2)
    llama = lambda device: Llama(llama_config("llama_tiny", layers=4), device=device)  # noqa: E731
    with pytest.raises(MeshlmError, match=r"context\.balance\), so it must be a multiple of 2\*cp = 4"):
        plan_model(llama, "fsdp_cp_pp", {"cp": 2, "pp": 2}, global_batch=B, seq=30, grad_accum=2)
