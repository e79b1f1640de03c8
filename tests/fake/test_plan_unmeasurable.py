"""A step the planner cannot run on fake tensors is an error in the model's terms (NOTE
[unmeasurable step] in meshlm/plan/where.py): the module, the op, the model's line, the
layout and mesh, and what to do; never a DTensor traceback.  The models are a user's, in
plain torch (tests/dist/test_plan_measured.py holds the measurable ones to real steps)."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

from test_plan_measured import UserLM  # noqa: E402  (a plain-torch model with einsum attention)


class CountingLM(UserLM):
    """Divides the summed loss by the number of targets it reads back to Python (one block:
    the read-back comes after it)."""

    def __init__(self):
        super().__init__(depth=1)

    def forward(self, tokens, targets):
        out = super().forward(tokens, targets)
        n = int((targets >= 0).sum())  # the line the error must name
        return {"loss": out["loss"] * targets.numel() / n}


COUNT_LINE = next(
    i for i, line in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1) if "n = int(" in line
)


def _plan(build, layout, mesh):
    from meshlm.plan import plan_model

    return plan_model(build, layout, mesh, global_batch=4, seq=16, name="counting")


@pytest.mark.parametrize("layout,mesh", [("ddp", {"dp": 2}), ("fsdp_tp", {"fsdp": 2, "tp": 2})])
def test_a_value_read_back_names_the_line(layout, mesh):
    from meshlm.plan.where import Unmeasurable

    with pytest.raises(Unmeasurable) as e:
        _plan(lambda device: CountingLM(), layout, mesh)
    msg = str(e.value)
    assert f"could not measure layout {layout} on mesh {mesh}" in msg
    assert "the model's top level runs aten._local_scalar_dense.default in forward" in msg
    assert f"{__file__}:{COUNT_LINE} `n = int((targets >= 0).sum())" in msg
    assert "keep the value a tensor" in msg and "Sharding propagation" not in msg


def test_dtensor_propagation_that_needs_data_names_the_module(monkeypatch):
    """Without meshlm's fix for strided shards (a torch where it does not apply), the
    einsum attention's ``bmm`` under fsdp_tp makes DTensor's sharding rule read sizes back
    from a fake tensor: the error names the attention module, the line of its forward, the
    op and the layout."""
    from meshlm import _torch_compat as compat
    from meshlm.plan.where import Unmeasurable

    monkeypatch.setattr(compat, "dtensor_index_math_outside_fake", contextlib.nullcontext)
    with pytest.raises(Unmeasurable) as e:
        _plan(lambda device: UserLM(out="loss"), "fsdp_tp", {"fsdp": 2, "tp": 2})
    msg = str(e.value)
    assert "could not measure layout fsdp_tp on mesh {'fsdp': 2, 'tp': 2}: module `attn.0`" in msg, msg
    # forward or backward: which of the two first reads a size back depends on how DTensor
    # prices the candidate strategies (NOTE [strided costs]); the backward's attribution has
    # its own test below
    phase = re.search(r"runs aten\.bmm\.default in (forward|backward) at ", msg)
    assert phase, msg
    # forward names the einsum's line; backward (no line of the forward runs) the forward it belongs to
    named = "torch.einsum(" if phase.group(1) == "forward" else "EinsumAttention.forward, "
    assert "test_plan_measured.py:" in msg and named in msg, msg
    assert "plan another layout" in msg and "Traceback" not in msg


class _ReadsBack(torch.autograd.Function):
    """Identity forward; its backward reads the gradient's size back to Python."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / max(1, int(g.abs().sum() > 0))


class ScaledMLP(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        import meshlm

        self.fc = meshlm.set_axes(torch.nn.Linear(width, width), weight=("mlp", "embed"), bias=("mlp",))

    def forward(self, x):
        return _ReadsBack.apply(self.fc(x))


def test_a_read_back_in_backward_names_the_module_it_came_from():
    """A value read back in backward (NOTE [unmeasurable step]): the error names the module
    whose forward built that autograd node and says backward."""
    from meshlm.plan.where import Unmeasurable

    class LM(UserLM):
        def __init__(self):
            super().__init__()
            self.scaled = ScaledMLP()

        def forward(self, tokens, targets):
            import meshlm

            x = meshlm.constrain(self.wte(tokens), ("batch", "seq", "embed"))
            x = self.scaled(x)
            logits = self.head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with pytest.raises(Unmeasurable) as e:
        _plan(lambda device: LM(), "ddp", {"dp": 2})
    msg = str(e.value)
    assert "module `scaled` runs aten._local_scalar_dense.default in backward at ScaledMLP.forward, " in msg, msg


def test_layout_auto_says_why_when_no_candidate_can_be_measured(tmp_path):
    """Every candidate unmeasurable: the error is the step's, not "no factorisation divides"."""
    import io

    from meshlm.plan.search import choose_layout
    from meshlm.plan.where import Unmeasurable

    def planner(layout, mesh):
        return _plan(lambda device: CountingLM(), layout, mesh)

    with pytest.raises(Unmeasurable, match=r"could not measure layout .* aten._local_scalar_dense"):
        choose_layout(
            devices=2, global_batch=4, seq=16, planner=planner, png=str(tmp_path / "p.png"), out=io.StringIO()
        )
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("layout,mesh", [("fsdp", {"fsdp": 2})])
def test_every_output_container_plans_alike(layout, mesh):
    """The same model with its loss returned alone, in a dict, or as ``.loss`` (what
    ``meshlm train`` reads: ``meshlm.models.node.loss_of``) plans alike.  The einsum attention
    under fsdp_tp (a strided shard, ~12 s a plan on two cores) is planned and held to a real
    step with the ``.loss`` output in tests/dist/test_plan_measured.py
    (test_measured_plan_is_exact_for_einsum_attention_on_2d_meshes), the dict output under
    tp there too."""
    plans = [_plan(lambda device, o=o: UserLM(out=o), layout, mesh).memory for o in ("loss", "dict", "attr")]
    assert plans[0] == plans[1] == plans[2], plans
