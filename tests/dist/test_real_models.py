"""Models the library's code did not shape, trained under the shipped layouts against plain
torch on one process (``check_training``: loss, the gradient each optimizer steps with,
parameters and optimizer state after 3 steps of SGD and of AdamW with weight decay):

- a parameter that gets no gradient in a step keeps ``grad is None`` and torch.optim skips it
  (NOTE [unused parameters] in meshlm/runtime/unused.py): a branch unused on some steps, inside and
  outside blocks, used on one data-parallel rank only, and a mixture-of-experts layer whose
  unrouted experts get no gradient;
- micro-batches of unequal token counts weigh as the whole batch on one device (NOTE [token
  weighting] in meshlm/core/weighting.py), for ``F.cross_entropy(ignore_index=...)`` and for a
  masked mean written by hand through ``meshlm.reduce_batch(..., weight=)``.

The models are plain torch modules (``nn.Linear``, ``nn.Embedding``) with their axes given by
``meshlm.set_axes``.  Tolerances: tests/harness/tolerances.py."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from harness import dist_pool_fixture
from harness import tolerances as tol
from harness.parity import assert_parity, check_training

pool2 = dist_pool_fixture(2, timeout_s=90)
pool4 = dist_pool_fixture(4, timeout_s=90)

VOCAB, EMBED, MLP, BATCH, SEQ = 64, 16, 32, 8, 8


class Lin(nn.Linear):
    """torch's Linear (its own initialisation when built on CPU), and an ``init_weights`` so
    that a pipeline's stages can initialise it from a seed on the meta device."""

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.weight, std=0.2, generator=gen)


class Emb(nn.Embedding):
    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.weight, generator=gen)


def _lin(i: int, o: int, axes) -> nn.Linear:
    return meshlm.set_axes(Lin(i, o, bias=False), weight=axes)


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = _lin(EMBED, MLP, ("mlp", "embed"))
        self.down = _lin(MLP, EMBED, ("embed", "mlp"))

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@meshlm.block
class Block(nn.Module):
    """An MLP always used, and ``alt`` used on the gated rows only: a rank whose rows have
    no gate does not call it at all."""

    def __init__(self):
        super().__init__()
        self.ffn = FFN()
        self.alt = FFN()

    def forward(self, x, gate):
        h = x + self.ffn(x)
        if gate is not None and bool(gate.any()):
            h = h + self.alt(x) * gate[:, None, None].to(x.dtype)
        return h


class Branchy(nn.Module):
    """Embedding, two blocks and a head; the root's ``extra`` projection is used on the gated
    rows only, like the blocks' ``alt``.  A row is gated for the blocks when its first token
    is below VOCAB // 4, for the root when its second is.  ``F.cross_entropy`` with
    ignore_index -100."""

    def __init__(self, masked_mean: bool = False, gated: bool = True):
        super().__init__()
        self.gated = gated  # False: ``alt`` and ``extra`` are never used
        self.embed = meshlm.set_axes(Emb(VOCAB, EMBED), weight=("vocab", "embed"))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.extra = _lin(EMBED, EMBED, ("embed", None))
        self.head = _lin(EMBED, VOCAB, ("vocab", "embed"))
        self.masked_mean = masked_mean

    def forward(self, tokens, targets):
        gate, root_gate = tokens[:, 0] < VOCAB // 4, tokens[:, 1] < VOCAB // 4
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, gate if self.gated else None)
        if self.gated and bool(root_gate.any()):
            x = x + self.extra(x) * root_gate[:, None, None].to(x.dtype)
        logits = self.head(x)
        if not self.masked_mean:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        # a token mean written by hand: its count declared as the weight
        mask = (targets >= 0).to(logits.dtype)
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.clamp_min(0).flatten(), reduction="none")
        total = (per_token.view_as(mask) * mask).sum()
        return meshlm.reduce_batch(total / mask.sum(), "mean", weight=mask.sum())


@meshlm.block
class MoEBlock(nn.Module):
    """Top-1 routing over 4 experts, the last never routed to (its logit is masked): an
    expert that no token of any rank reaches has no gradient, and one routed on some
    ranks only is used."""

    E = 4

    def __init__(self):
        super().__init__()
        self.router = _lin(EMBED, self.E, (None, "embed"))
        self.experts = nn.ModuleList([FFN() for _ in range(self.E)])

    def forward(self, x):
        logits = self.router(x).float()
        logits = logits.masked_fill(torch.arange(self.E, device=x.device) == self.E - 1, float("-inf"))
        prob, choice = logits.softmax(-1).max(-1)
        out = x
        for e, expert in enumerate(self.experts):
            sel = choice == e
            if bool(sel.any()):
                out = out + expert(x) * (prob * sel).unsqueeze(-1).to(x.dtype)
        return out


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = meshlm.set_axes(nn.Embedding(VOCAB, EMBED), weight=("vocab", "embed"))
        self.moe = MoEBlock()
        self.head = _lin(EMBED, VOCAB, ("vocab", "embed"))

    def forward(self, tokens, targets):
        logits = self.head(self.moe(self.embed(tokens)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_branchy(device: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Branchy()


def build_branchy_seeded(device: str, seed: int) -> nn.Module:
    """Without the data-dependent branches (a pipeline probes its model on the meta device,
    where no branch on the data can be taken): ``alt`` and ``extra`` are never used.  On the
    meta device for ``meshlm.shard`` to initialise from ``seed`` (pipeline stages), or on CPU
    initialised from it as one device would be (``meshlm.init_params``)."""
    with torch.device(device):
        m = Branchy(gated=False)
    if device != "meta":
        meshlm.init_params(m, seed)
    return m


def build_masked(device: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Branchy(masked_mean=True)


def build_moe(device: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyMoE()


@dataclass(frozen=True)
class Gated:
    """Which rows take the data-dependent branches (``alt`` in the blocks, ``extra`` at the
    root), step by step, on two data-parallel ranks (rows split in halves):

    - step 1: the first half in the first micro-batch, the second half in the second: each
      rank uses them in one micro-batch and not in the other, so they are used;
    - step 2: the first half only (rank 0's) in both micro-batches: used on one rank only, so
      used; the root's gate likewise where ``root_per_rank``, else on no row;
    - step 3: no row: unused everywhere, after two steps that used them (AdamW's moments
      and weight decay, SGD's momentum would move them if they were stepped).

    Targets: the first micro-batch of each step counts 2 per row, the second all but one (16
    and 56 of 64).  ``root_per_rank=False`` for the ZeRO-3 layouts, which gather a parameter
    outside blocks at its use, so that it must be used on every rank or on none (NOTE [unused
    parameters]): there the root's gate is on every row in step 1 and on none after."""

    root_per_rank: bool = True

    def __call__(self, step: int, micro: int):
        gen = torch.Generator().manual_seed(100 * step + micro)
        tokens = torch.randint(VOCAB // 4, VOCAB, (BATCH, SEQ), generator=gen)
        low = torch.randint(0, VOCAB // 4, (BATCH, 2), generator=gen)
        half = slice(BATCH // 2, BATCH) if step == 1 and micro == 1 else slice(0, BATCH // 2)
        if step <= 2:
            tokens[half, 0] = low[half, 0]
            if self.root_per_rank:
                tokens[half, 1] = low[half, 1]
            elif step == 1:
                tokens[:, 1] = low[:, 1]
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        if micro == 0:
            targets[:, 2:] = -100
        else:
            targets[:, :1] = -100
        return (tokens, targets), {}


def moe_batches(step: int, micro: int):
    gen = torch.Generator().manual_seed(7 + 100 * step + micro)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    ), {}


def _check(layout, mesh, build, batches):
    return check_training(layout, mesh, build=build, batches=batches, from_seed=False)


ZERO3 = {"fsdp", "hsdp", "fsdp_tp"}
LAYOUTS_2 = [
    ("single", "dp=2"),
    ("ddp", "dp=2"),
    ("zero1", "dp=2"),
    ("zero2", "dp=2"),
    ("fsdp", "fsdp=2"),
    ("tp", "tp=2"),
]
LAYOUTS_4 = [("fsdp_tp", "fsdp=2,tp=2"), ("hsdp", "dp=2,fsdp=2")]


@pytest.mark.parametrize("layout,mesh", LAYOUTS_2, ids=[f"{a}-{b}" for a, b in LAYOUTS_2])
def test_unused_branch_and_uneven_tokens_2(pool2, layout, mesh):
    assert_parity(pool2.run(_check, layout, mesh, build_branchy, Gated(layout not in ZERO3)))


@pytest.mark.parametrize("layout,mesh", LAYOUTS_4, ids=[f"{a}-{b}" for a, b in LAYOUTS_4])
def test_unused_branch_and_uneven_tokens_4(pool4, layout, mesh):
    assert_parity(pool4.run(_check, layout, mesh, build_branchy, Gated(layout not in ZERO3)))


def _check_seeded(layout, mesh, batches):
    return check_training(layout, mesh, build=build_branchy_seeded, batches=batches)


def test_unused_branch_and_uneven_tokens_in_a_pipeline(pool2):
    """pp=2: the blocks' ``alt`` in each stage and ``extra`` on the last get no gradient (AdamW's
    weight decay would move them), micro-batches of uneven counted targets weighed by the
    pipeline's loss function (NOTE [token weighting])."""
    assert_parity(pool2.run(_check_seeded, "pp", "pp=2", Gated(True)))


def test_unused_branch_and_uneven_tokens_in_a_zero3_pipeline(pool4):
    assert_parity(pool4.run(_check_seeded, "fsdp_pp", "fsdp=2,pp=2", Gated(False)))


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2")])
def test_masked_mean_by_hand(pool2, layout, mesh):
    assert_parity(pool2.run(_check, layout, mesh, build_masked, Gated(layout not in ZERO3)))


@pytest.mark.parametrize("layout,mesh", [("single", "dp=2"), ("ddp", "dp=2"), ("zero2", "dp=2"), ("fsdp", "fsdp=2")])
def test_moe_unrouted_experts(pool2, layout, mesh):
    assert_parity(pool2.run(_check, layout, mesh, build_moe, moe_batches))


# --------------------------------------------------------------------------- the training loop
# ``meshlm train``'s own loop (``meshlm.app.train.run``) over a user's model whose loss ignores
# the targets below 'a' (spaces, capitals, punctuation of the shipped text): micro-batches
# then count different numbers of targets, and the step must weigh them as one device
# weighs the whole batch.  Tolerances: NOTE [invariance tolerance] (these are 3 of the 12
# steps it is derived for).

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

SPARSE = {"_target_": "test_real_models.SparseTargets", "width": 32, "depth": 2, "heads": 4, "mlp": 64}


def _sparse_lm():
    from mymodels import TinyLM

    class SparseTargets(TinyLM):
        def forward(self, tokens, targets):
            return super().forward(tokens, torch.where(targets >= ord("a"), targets, -100))

    return SparseTargets


def __getattr__(name):  # the model class, defined lazily so that collecting this module needs no mymodels
    if name == "SparseTargets":
        cls = _sparse_lm()
        cls.__module__, cls.__qualname__ = __name__, "SparseTargets"
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _train(layout: str, mesh: dict, grad_accum: int, run_dir: str) -> list[float]:
    import torch.distributed as dist

    from meshlm.app.config import from_dict
    from meshlm.app.train import run

    t = {"steps": 3, "batch_size": 8, "seq_len": 16, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 1,
         "val_every": 0, "val_batches": 1, "progress": False, "count_comm": False, "pg_timeout_s": 60,
         "grad_accum": grad_accum}
    run(from_dict({"model": SPARSE, "layout": {"name": layout}, "mesh": mesh, "train": t}), run_dir)
    dist.barrier()
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole_batch(pool4, tmp_path_factory):
    """The curve of each step's whole batch in one forward (no accumulation)."""
    return pool4.run(_train, "single", {"dp": 4}, 1, str(tmp_path_factory.mktemp("whole")))[0]


@pytest.mark.parametrize(
    "layout,mesh,grad_accum",
    [("single", {"dp": 4}, 4), ("ddp", {"dp": 4}, 2), ("fsdp_tp", {"fsdp": 2, "tp": 2}, 2),
     ("fsdp_pp", {"fsdp": 2, "pp": 2}, 2)],
    ids=["single-accum4", "ddp-accum2", "fsdp_tp-accum2", "fsdp_pp"],
)
def test_train_weighs_micro_batches_by_their_targets(pool4, whole_batch, tmp_path, layout, mesh, grad_accum):
    got = pool4.run(_train, layout, mesh, grad_accum, str(tmp_path))[0]
    assert len(got) == 3
    assert abs(got[0] - whole_batch[0]) <= tol.LOSS_RTOL * whole_batch[0], (got, whole_batch)
    assert max(abs(a - b) / b for a, b in zip(got, whole_batch)) <= tol.INVARIANCE_RTOL, (got, whole_batch)
