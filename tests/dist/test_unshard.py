"""``meshlm.unshard`` (NOTE [unshard] in meshlm/runtime/unshard.py) after training, on 4 gloo
processes, under every shipped layout (``layouts/*.yaml``; the pipeline layouts on pp
meshes, the scoped ``vlm_fsdp_tp`` on the vision-language model it is written for): the
reference Llama, and under every layout without pipeline stages a plain torch model meshlm
did not shape (torch's layers in an ``nn.Sequential``, annotated with ``meshlm.set_axes``,
with a tied head and buffers), trained a step of SGD against the same model in plain
torch on one process (``check_training``), then unsharded.  Checked on every rank, against
the one-process reference (nothing from meshlm):

- every submodule's class is the reference's (no ``Sharded<...>``), with the reference's
  attributes (no meshlm attribute, no own call) and no hook; every parameter a plain
  ``nn.Parameter`` on the CPU without a gradient, every buffer a plain tensor, no DTensor
  anywhere; the state_dict keys in the reference's order; tied slots one Parameter, as in
  the reference;
- every weight within the bound ``check_training`` derives for the parameter after those
  steps (tests/harness/tolerances.py, NOTE [tolerances after steps]), every buffer within
  the harness's buffer tolerance (integer ones exact);
- the unsharded model's forward, on one process, is bit for bit that of a plain model of
  the same class loaded with its weights, and within the harness's loss tolerance of the
  sharded model's forward on the same batch just before ``unshard``.

Also: activation checkpointing comes off (compiled blocks: tests/unit/test_unshard_one_rank.py);
offloaded parameters come back from disk, their files removed, equal to a run without
offload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from harness import dist_pool_fixture
from harness import tolerances as tol
from harness.parity import LlamaBuild, MoEBuild, TokenBatches, VlmBatches, VlmBuild, assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=120)

LAYOUTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "layouts").glob("*.yaml"))
LLAMA = LlamaBuild("llama_tiny")
LLAMA4 = LlamaBuild("llama_tiny", (("layers", 4),))  # 4 blocks: one stage per rank on pp=4
# (layout, mesh of 4, check_training's extra arguments): every shipped layout once
CASES = [
    ("single", "dp=4", {}),
    ("ddp", "dp=4", {}),
    ("zero1", "dp=2,fsdp=2", {}),
    ("zero2", "dp=4", {}),
    ("fsdp", "fsdp=4", {"activation_checkpointing": "full"}),
    ("hsdp", "dp=2,fsdp=2", {}),
    ("tp", "tp=4", {}),
    ("tp_sp", "fsdp=2,tp=2", {}),
    ("fsdp_tp", "fsdp=2,tp=2", {}),
    ("fsdp_tp_sp", "fsdp=2,tp=2", {}),
    ("pp", "pp=4", {"build": LLAMA4, "schedule": "gpipe"}),  # 1f1b needs 4 micro-batches on pp=4
    ("fsdp_pp", "fsdp=2,pp=2", {"build": LLAMA4}),
    ("fsdp_tp_pp", "tp=2,pp=2", {"build": LLAMA4}),
    ("vlm_fsdp_tp", "fsdp=2,tp=2", {}),  # the vision-language model (below), scoped layouts
    ("fsdp_cp", "fsdp=2,cp=2", {}),
    ("fsdp_tp_cp", "tp=2,cp=2", {}),
    ("fsdp_ep", "fsdp=2,ep=2", {"build": MoEBuild()}),  # experts split over ep
    ("fsdp_tp_ep", "tp=2,ep=2", {"build": MoEBuild()}),
    ("fsdp_ep_pp", "ep=2,pp=2", {"build": MoEBuild()}),  # experts over ep inside 2 stages
    ("fsdp_cp_pp", "cp=2,pp=2", {"build": LLAMA4}),
]
PIPELINED = {"pp", "fsdp_pp", "fsdp_tp_pp", "fsdp_ep_pp", "fsdp_cp_pp"}


class SeqLM(nn.Module):
    """A plain torch model: an embedding, an ``nn.Sequential`` MLP, a head tied to the
    embedding, a running mean of the embeddings (updated in training, used in eval) and a
    non-persistent scale; every parameter annotated with ``meshlm.set_axes``, no block."""

    def __init__(self, vocab: int = 256, width: int = 16, mlp: int = 32):
        super().__init__()
        self.emb = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.mlp = nn.Sequential(
            meshlm.set_axes(nn.LayerNorm(width), weight=("embed",), bias=("embed",)),
            meshlm.set_axes(nn.Linear(width, mlp), weight=("mlp", "embed"), bias=("mlp",)),
            nn.GELU(),
            meshlm.set_axes(nn.Linear(mlp, width), weight=("embed", "mlp"), bias=("embed",)),
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: the head takes the embedding's axes
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)

    def forward(self, tokens, targets):
        x = meshlm.constrain(self.emb(tokens), ("batch", "seq", "embed"))
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
        else:
            x = x - self.running_mean
        x = meshlm.constrain(x + self.mlp(x) * self.scale, ("batch", "seq", "embed"))
        logits = meshlm.constrain(self.head(x), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


@dataclass(frozen=True)
class SeqBuild:
    """``build`` for check_training: the model's own torch init from the seed."""

    def __call__(self, device: str, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return SeqLM()


VLM = {"build": VlmBuild(), "batches": VlmBatches(), "input_axes": {2: ("batch", "channels", None, None)}}
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def check_plain(model: nn.Module, ref: nn.Module) -> None:
    """``model`` is a plain torch module shaped exactly as ``ref`` (a plain build of it)."""
    from torch.distributed.tensor import DTensor

    mods, refs = list(model.named_modules()), list(ref.named_modules())
    assert [n for n, _ in mods] == [n for n, _ in refs]
    for (name, m), (_, r) in zip(mods, refs):
        assert type(m) is type(r), f"{name}: {type(m).__qualname__} is not {type(r).__qualname__}"
        assert set(vars(m)) == set(vars(r)), f"{name}: attributes {sorted(set(vars(m)) ^ set(vars(r)))}"
        for d in HOOK_DICTS:
            assert len(getattr(m, d)) == len(getattr(r, d)), f"{name}: {d} left"
    for n, p in model.named_parameters():
        assert type(p) is nn.Parameter and not isinstance(p.data, DTensor), n
        assert p.device.type == "cpu" and p.grad is None and p.is_leaf, n
    for n, b in model.named_buffers():
        assert type(b) is torch.Tensor and b.device.type == "cpu", n
    assert list(model.state_dict()) == list(ref.state_dict())

    def sharing(mod):  # which slots hold one object
        first: dict[int, int] = {}
        return [first.setdefault(id(p), i) for i, (_n, p) in enumerate(mod.named_parameters(remove_duplicate=False))]

    assert sharing(model) == sharing(ref)


def _after(model, ref, bounds, job):
    """check_training's ``after``: unshard, then the checks of the module docstring."""
    from harness.recipes import forward_seed

    args, kwargs = job.batches(9, 0)  # a batch no step trained on
    model.eval()
    ref.eval()
    torch.manual_seed(forward_seed(0, 9, 0))
    pipe = getattr(job.runner, "pipe", None)
    a, kw = job._shard(args, kwargs)
    if pipe is not None:
        before = torch.tensor(pipe.evaluate([(tuple(a), kw)]), dtype=torch.float64)
    else:
        with torch.no_grad():
            before = model(*a, **kw).double()
    out = meshlm.unshard(model)
    assert out is model
    check_plain(model, ref)
    worst = 0.0
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        r = tol.ratio(p.detach() - refp[n].detach(), bounds[n])
        assert r <= 1.0, f"{job.layout}: unsharded {n} is {r:.3g}x its tolerance from the one-device run"
        worst = max(worst, r)
    refb = dict(ref.named_buffers())
    for n, b in model.named_buffers():
        if not b.is_floating_point():
            assert torch.equal(b, refb[n]), n
            continue
        bound = torch.full_like(refb[n], tol.BUFFER_ATOL_OF_MAX * float(refb[n].abs().max()))
        assert tol.ratio(b - refb[n], bound) <= 1.0, f"{job.layout}: buffer {n}"
    with torch.no_grad():
        torch.manual_seed(forward_seed(0, 9, 0))
        got = model(*args, **kwargs)
        fresh = job.build("cpu", 0)
        fresh.load_state_dict(model.state_dict())
        for n, b in model.named_buffers():  # the non-persistent ones too
            fresh.get_buffer(n).copy_(b)
        fresh.eval()
        torch.manual_seed(forward_seed(0, 9, 0))
        want = fresh(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert abs(float(got) - float(before)) <= tol.LOSS_RTOL * abs(float(got)), (float(got), float(before))
    return worst


def _train_and_unshard(layout: str, mesh: str, **kw) -> list:
    results = []
    builds = [kw.pop("build", LLAMA)] if layout not in ("vlm_fsdp_tp",) else [None]
    if layout not in PIPELINED and layout != "vlm_fsdp_tp":
        builds.append(SeqBuild())
    for build in builds:
        extra = dict(VLM) if build is None else {"build": build, "batches": TokenBatches()}
        if isinstance(build, SeqBuild):
            extra["from_seed"] = False
            kw = {k: v for k, v in kw.items() if k != "activation_checkpointing"}
        extra.setdefault("grad_accum", 2 if layout in PIPELINED else 1)  # a pipeline's schedule needs 2
        results.append(check_training(layout, mesh, optims=("sgd",), steps=1, after=_after, **extra, **kw))
    return results


def test_every_layout_is_covered():
    assert sorted(layout for layout, _m, _kw in CASES) == LAYOUTS


@pytest.mark.parametrize("layout,mesh,kw", CASES, ids=[c[0] for c in CASES])
def test_unshard_after_training(pool4, layout, mesh, kw):
    for per_rank in zip(*pool4.run(_train_and_unshard, layout, mesh, **kw)):
        assert_parity(list(per_rank))
        assert all(r["after"]["sgd"] <= 1.0 for r in per_rank)


def _offloaded(base: str) -> dict:
    """fsdp on 4 ranks, two steps of SGD, with every block's parameters on disk between uses
    (NOTE [offloaded parameters]) and without; both unsharded."""
    import torch.distributed as dist

    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.params import ParamOffload
    from meshlm.runtime.offload.store import SwapDir, Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh("fsdp=4")
    disk = SwapDir(base, dist.get_rank(), run_id="unshard")
    models, names = [], []
    for offload in (False, True):
        model = meshlm.shard(Llama(cfg, device="meta"), "fsdp", mesh, seed=0)
        poff = ParamOffload(model, Swapper("disk", disk)) if offload else None
        opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.5, momentum=0.9, offload_params=poff)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x, y = (torch.randint(0, cfg.vocab, (8, 16), generator=g) for _ in range(2))
            model(meshlm.shard_batch(x, "fsdp", mesh), meshlm.shard_batch(y, "fsdp", mesh)).backward()
            opt.step()
            opt.zero_grad()
        names.append(type(model.layers[0]).__name__)
        on_disk = disk.disk_bytes()
        assert meshlm.unshard(model) is model
        models.append(model)
    check_plain(models[1], Llama(cfg, seed=0))
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), n
    out = {"names": names, "on_disk": on_disk, "left": disk.disk_bytes()}
    disk.close()
    return out


def test_unshard_offloaded_parameters(pool4, tmp_path):
    for r in pool4.run(_offloaded, str(tmp_path)):
        assert r["names"] == ["ShardedTransformerBlock", "OffloadedShardedTransformerBlock"]
        assert r["on_disk"] > 0 and r["left"] == 0, r
