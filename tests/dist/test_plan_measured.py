"""The measured planner (meshlm.plan.plan_model: one training step of the model on fake
tensors, NOTE [fake measurement] in meshlm/plan/measure.py) against a real step on 2 and 4
gloo processes, for a model that is not ours: the GPT-2 of tests/dist/test_nn_models.py
(LayerNorm, biases, learned positions, fused QKV, tied head), under every shipped layout.
Equal to the byte: parameter, gradient and optimizer bytes per rank, the activations held
from forward to backward (NOTE [measuring held activations] in test_plan_exact.py), the
peak of live tensor storage in a step as ``meshlm train`` measures it (NOTE [run memory]
in meshlm/train/metrics.py), and every collective's count and bytes per (kind, axes, phase).
The peak and the held activations are equal but for the collective buffers that gloo's
thread happened to free late in that run (NOTE [storage the backend frees] in
meshlm/runtime/memory.py: measured in the same run, usually 0).  The same for a user's model in a package of its own (tests/usermodel/mymodels), built from
its Hydra node exactly as ``meshlm plan model._target_=mymodels.TinyLM`` builds it."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshlm.layout.rules import is_pipelined, load_layout, shipped_layouts
from harness import dist_pool_fixture

B, S = 8, 16
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)


USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)


def _build(device):
    from test_nn_models import GPT, GPTConfig

    return GPT(GPTConfig(), device=device)


def _build_user(device):
    """The user's model from its model node, as meshlm plan and meshlm train build it."""
    from meshlm.models.node import ModelConfig
    from meshlm.app.plan import build_model

    return build_model(ModelConfig(target="mymodels.TinyLM", args={"width": 32, "heads": 4}))(device)


class EinsumAttention(torch.nn.Module):
    """A user's attention in plain torch: q, k, v as ``nn.Linear`` over the heads axis, the
    scores and the weighted sum by ``torch.einsum`` (no SDPA), causal by a mask."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        import meshlm

        self.heads = heads
        self.q, self.k, self.v = (
            meshlm.set_axes(torch.nn.Linear(width, width, bias=False), weight=("heads", "embed")) for _ in range(3)
        )
        self.o = meshlm.set_axes(torch.nn.Linear(width, width, bias=False), weight=("embed", "heads"))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, d // self.heads) for lin in (self.q, self.k, self.v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.o(torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d))


@dataclass
class Output:
    """A Hugging Face style output: the loss as an attribute, beside the logits."""

    loss: torch.Tensor
    logits: torch.Tensor


class UserLM(torch.nn.Module):
    """A user's model in plain torch (``nn.Embedding``, ``nn.LayerNorm``, ``nn.Linear`` with
    their logical axes set) whose output is one of the containers ``meshlm train`` reads
    (``meshlm.models.node.loss_of``): a dict with a ``"loss"`` entry (``out="dict"``), an
    object with ``.loss`` (``"attr"``) or the loss (``"loss"``); blocks of einsum attention
    and an MLP."""

    def __init__(self, vocab=64, width=32, heads=4, depth=2, out="dict"):
        super().__init__()
        import meshlm

        self.out = out
        self.wte = meshlm.set_axes(torch.nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.attn = torch.nn.ModuleList(EinsumAttention(width, heads) for _ in range(depth))
        self.up = torch.nn.ModuleList(
            meshlm.set_axes(torch.nn.Linear(width, 2 * width), weight=("mlp", "embed"), bias=("mlp",))
            for _ in range(depth)
        )
        self.down = torch.nn.ModuleList(
            meshlm.set_axes(torch.nn.Linear(2 * width, width), weight=("embed", "mlp"), bias=("embed",))
            for _ in range(depth)
        )
        self.norm = meshlm.set_axes(torch.nn.LayerNorm(width), weight=("embed",), bias=("embed",))
        self.head = meshlm.set_axes(torch.nn.Linear(width, vocab, bias=False), weight=("vocab", "embed"))

    def forward(self, tokens, targets):
        import meshlm

        x = meshlm.constrain(self.wte(tokens), ("batch", "seq", "embed"))
        for attn, up, down in zip(self.attn, self.up, self.down):
            x = attn(x)
            x = x + down(torch.nn.functional.gelu(up(x)))
        logits = self.head(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if self.out == "dict":
            return {"loss": loss, "logits": logits}
        return Output(loss, logits) if self.out == "attr" else loss


def _build_dict(device):
    with torch.device(device):  # as meshlm.app.model_build builds a model node
        return UserLM(out="dict")


def _build_attr(device):
    """One block: DTensor prices every strided-shard candidate of its einsums by a search on a
    2-D mesh (~6 s of CPU a block and step), and one block has them all."""
    with torch.device(device):
        return UserLM(out="attr", depth=1)


BUILDS = {"gpt2": _build, "user": _build_user, "dict": _build_dict, "attr": _build_attr}


def _mesh(layout: str, world: int) -> dict[str, int]:
    from meshlm.layout.rules import load_layout

    lay = load_layout(layout)
    data = "fsdp" if any("fsdp" in v for v in lay.params.values()) else "dp"
    if "cp" in lay.mesh_axes_used():  # context parallel: the sequence split over cp
        if world == 2:
            return {"cp": 2}
        return {"tp": 2, "cp": 2} if "tp" in lay.mesh_axes_used() else {data: 2, "cp": 2}
    if "tp" in lay.mesh_axes_used():
        return {"tp": 2} if world == 2 else ({data: 2, "tp": 2} if data in lay.mesh_axes_used() else {"tp": 4})
    if layout == "hsdp" and world == 4:
        return {"dp": 2, "fsdp": 2}
    return {data: world}


def _real(layout: str, mesh_shape: dict, ac: str, model_name: str = "gpt2"):
    """One real step counted and its held activations measured as test_plan_exact does,
    then a second step measured as meshlm train measures its own."""
    from test_plan_exact import _count_at_use, _HeldAfterForward, _local

    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.app.config import TrainConfig
    from meshlm.models.node import ModelConfig, loss_of
    from meshlm.runtime.memory import model_state_bytes
    from meshlm.train.metrics import StepMemory
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.app.train import apply_activation_checkpointing, shard_dtypes

    _count_at_use()  # what the parameter gathers make is told apart (NOTE [measuring held activations])
    mesh = meshlm.make_mesh(mesh_shape)
    kw = shard_dtypes(TrainConfig(), meshlm.load_layout(layout), mesh_shape)
    # a plain-torch model is built with its weights on the host, as meshlm train builds one
    # (NOTE [model build] in meshlm/app/model_plain.py); the planner builds every model on meta
    torch.manual_seed(0)
    device = "cpu" if model_name in ("dict", "attr") else "meta"
    model = meshlm.shard(BUILDS[model_name](device), layout, mesh, seed=0, **kw)
    apply_activation_checkpointing(model, ac)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    toks = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(0))
    x, y = (meshlm.shard_batch(t, layout, mesh) for t in (toks[:, :-1], toks[:, 1:]))
    cc, held = CommCounter(mesh), _HeldAfterForward()
    with cc:
        with held:
            loss = loss_of(model(x, y), ModelConfig(name=model_name))  # as meshlm train reads the output
        act, gathered = held.held({_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), x, y, loss]})
        loss.backward()
        with cc.phase("optimizer"):
            opt.step()
    opt.zero_grad()
    held_slack = held.backend_slack()
    del x, y
    with StepMemory(model, opt, torch.device("cpu")) as mem:
        # this rank's batch made in the step, as train's loader makes it (it counts in the peak)
        x, y = (meshlm.shard_batch(t, layout, mesh) for t in (toks[:, :-1], toks[:, 1:]))
        loss = loss_of(model(x, y), ModelConfig(name=model_name))  # held through backward, as train holds it
        (loss / 1).backward()  # train's loss / train.grad_accum
        mem.after_backward()
        opt.step()
        # ZeRO-1's gradients peak in the step (NOTE [main grads] in meshlm/runtime/main_grad.py)
        grads = max(mem.grads, model_state_bytes(model, opt)["grads"])
    comm = {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary(by_phase=True).items()}
    return dict(
        mem.result,
        grads=grads,
        activations=act + gathered,
        gathered=gathered,
        comm=comm,
        backend_slack=mem.backend_slack,
        held_slack=held_slack,
    )


def _check(pool, world: int, layout: str, ac: str = "none", model: str = "gpt2") -> None:
    from meshlm.app.config import TrainConfig
    from meshlm.layout.rules import load_layout
    from meshlm.plan import plan_model
    from meshlm.app.train import shard_dtypes

    mesh = _mesh(layout, world)
    got = pool.run(_real, layout, mesh, ac, model)[0]
    p = plan_model(
        BUILDS[model],
        layout,
        mesh,
        global_batch=B,
        seq=S,
        activation_checkpointing=ac,
        shard_kw=shard_dtypes(TrainConfig(), load_layout(layout), mesh),
    )
    planned = {k: p.memory[k] for k in ("params", "grads", "optimizer")}
    measured = {k: got[k] for k in planned}
    assert planned == measured, f"{layout} {mesh} {ac}: planned {planned} measured {measured}"
    # NOTE [storage the backend frees] in meshlm/runtime/memory.py: gloo's thread may hold a
    # collective's buffer past the program's last use; the fake step has no such thread.
    act = (got["activations"] - got["held_slack"], got["activations"])
    held = p.memory["activations"] + p.memory["gathered"]  # the real step's held storage counts both
    assert act[0] <= held <= act[1], (
        f"{layout} {mesh} {ac}: planned held {held}, measured {got['activations']} "
        f"of which up to {got['held_slack']} held by the backend's thread"
    )
    # the parameter copies among them (NOTE [parameter copies] in meshlm/plan/measure.py): what the
    # real step's parameter gathers made (NOTE [measuring held activations] in test_plan_exact.py)
    assert got["gathered"] - got["held_slack"] <= p.memory["gathered"] <= got["gathered"], (
        f"{layout} {mesh} {ac}: planned parameter copies {p.memory['gathered']}, the real step's gathers "
        f"{got['gathered']}"
    )
    pc = {k: (int(v["count"]), int(v["bytes"])) for k, v in p.comm_summary(by_phase=True).items()}
    assert pc == got["comm"], f"{layout} {mesh} comm: planned {pc}\nmeasured {got['comm']}"
    lo, hi = got["peak"] - got["backend_slack"], got["peak"]
    assert lo <= p.memory["peak"] <= hi, (
        f"{layout} {mesh} {ac}: planned peak {p.memory['peak']}, measured {got['peak']} of which up to "
        f"{got['backend_slack']} held by the backend's thread"
    )


# pipeline layouts (layers: pp): the measured planner does not model stages yet
# scoped layouts (vlm_fsdp_tp): planned for the vision-language model in tests/dist/test_vlm.py
# context parallel (cp) layouts run here on cp=2 alone and below on 2-D meshes with cp
@pytest.mark.parametrize("layout", [n for n in shipped_layouts()
                                    if not is_pipelined(load_layout(n)) and not load_layout(n).scopes])
def test_measured_plan_is_exact_for_gpt2_2(pool2, layout):
    _check(pool2, 2, layout)


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp", "fsdp_tp_sp", "fsdp_cp", "fsdp_tp_cp"])
def test_measured_plan_is_exact_for_gpt2_4(pool4, layout):
    """2-D meshes; under cp the sequence split over cp (fsdp=2 x cp=2, tp=2 x cp=2): the ring's
    sends and receives, the cp gradient buckets and the held activations planned as run."""
    _check(pool4, 4, layout)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_measured_plan_is_exact_for_gpt2_checkpointed(pool2, ac):
    _check(pool2, 2, "fsdp", ac)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "tp_sp", "fsdp_tp"])
def test_measured_plan_is_exact_for_a_users_model(pool2, layout):
    _check(pool2, 2, layout, model="user")


@pytest.mark.parametrize("layout", ["ddp", "zero2", "fsdp", "tp", "tp_sp", "fsdp_tp"])
def test_measured_plan_is_exact_for_a_dict_output_and_einsum_attention(pool2, layout):
    """A plain-torch model whose forward returns ``{"loss": ..., "logits": ...}`` (the
    trainer's output contract) and whose attention is ``torch.einsum``: planned as trained."""
    _check(pool2, 2, layout, model="dict")


@pytest.mark.parametrize("layout", ["fsdp_tp", "fsdp_tp_sp"])
def test_measured_plan_is_exact_for_einsum_attention_on_2d_meshes(pool4, layout):
    """The same model with a ``.loss`` output, on fsdp=2 x tp=2: its einsum operands are
    sharded over the batch and the flattened heads (a strided shard), whose sizes DTensor
    computes from a tensor (NOTE [unmeasurable step] in meshlm/plan/where.py)."""
    _check(pool4, 4, layout, model="attr")


def test_plans_printed_command_runs(tmp_path):
    """`meshlm plan layout=auto` ends with the `meshlm train` command of its winner, and that
    command trains the winner's layout on the winner's mesh."""
    import json
    import shlex

    from test_train_cli import TINY, meshlm

    r = meshlm(
        "plan",
        *TINY,
        "train.steps=2",
        "layout=auto",
        "plan.devices=2",
        "plan.profile=cpu",
        "plan.top=1",
        "plan.method=formula",  # the measured plan's command: tests/fake/test_plan_cli.py
        f"plan.png={tmp_path / 'plan.png'}",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    winner = r.stdout.splitlines()[2].split()  # rank, layout, mesh, ...
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("run it: meshlm train "), last
    args = shlex.split(last.removeprefix("run it: meshlm train "))
    t = meshlm("train", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert t.returncode == 0, t.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["world_size"] == 2 and f"layout {winner[1]}" in t.stdout, (winner, t.stdout[:500])
