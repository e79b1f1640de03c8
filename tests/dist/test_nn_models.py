"""A model written with meshlm.nn, as a model author writes one (not shaped by the library):
a tiny GPT-2 (LayerNorm with bias, biases on every Linear, learned positions, a fused QKV
Linear then split, the head tied to the token embedding nanoGPT's way).  It must train as
on one device under every shipped layout (harness.parity.check_training: loss,
gradients the optimizer steps with, parameters, optimizer state; SGD and AdamW, three
steps of two micro-batches), and its tie must be one parameter whose gradient is the sum
of both uses.  The fused QKV output has an axis of the model's own (``qkv``, NOTE [open
vocabulary] in meshlm/core/axes.py), which one case maps to tp in a layout of its own."""

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm import nn as mnn
from meshlm.layout.rules import is_pipelined, load_layout, shipped_layouts
from harness import WorkerError, dist_pool_fixture
from harness.parity import TokenBatches, assert_parity, check_training

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    block_size: int = 16
    layers: int = 2
    heads: int = 4
    embed: int = 32
    dropout: float = 0.0
    tied: bool = True
    norm: str = "layer"  # or "rms"
    head_first: bool = False  # lm_head registered before the transformer: the tie's first slot is the head's


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = mnn.Linear(cfg.embed, 3 * cfg.embed, axes=("embed", "qkv"), init_std=0.02, device=device)
        self.c_proj = mnn.Linear(cfg.embed, cfg.embed, axes=("heads", "embed"),
                                 init_std=0.02 / math.sqrt(2 * cfg.layers), device=device)

    def forward(self, x):
        b, t, d = x.shape
        x = meshlm.constrain(x, ("batch", None, "embed"))
        q, k, v = meshlm.constrain(self.c_attn(x), ("batch", None, "qkv")).split(d, dim=2)
        q, k, v = (meshlm.constrain(y.view(b, t, self.heads, d // self.heads).transpose(1, 2),
                                    ("batch", "heads", None, "head_dim")) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = meshlm.constrain(y, ("batch", "heads", None, "head_dim")).transpose(1, 2).flatten(2, 3)
        return meshlm.constrain(self.c_proj(y), ("batch", "seq", "embed"))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.c_fc = mnn.Linear(cfg.embed, 4 * cfg.embed, axes=("embed", "mlp"), init_std=0.02, device=device)
        self.c_proj = mnn.Linear(4 * cfg.embed, cfg.embed, axes=("mlp", "embed"),
                                 init_std=0.02 / math.sqrt(2 * cfg.layers), device=device)

    def forward(self, x):
        x = meshlm.constrain(x, ("batch", None, "embed"))
        h = meshlm.constrain(F.gelu(self.c_fc(x), approximate="tanh"), ("batch", None, "mlp"))
        return meshlm.constrain(self.c_proj(h), ("batch", "seq", "embed"))


def _norm(cfg: GPTConfig, device):
    return mnn.LayerNorm(cfg.embed, device=device) if cfg.norm == "layer" else mnn.RMSNorm(cfg.embed, device=device)


@meshlm.block
class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.ln_1 = _norm(cfg, device)
        self.attn = CausalSelfAttention(cfg, device)
        self.ln_2 = _norm(cfg, device)
        self.mlp = MLP(cfg, device)
        self.drop = mnn.Dropout(cfg.dropout, axes=("batch", "seq", "embed"))

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return meshlm.constrain(x, ("batch", "seq", "embed"))


class GPT(nn.Module):
    logical_axes: ClassVar[dict] = {"qkv": "queries, keys and values of every head, fused"}

    def __init__(self, cfg: GPTConfig, device=None, seed=0):
        super().__init__()
        if cfg.head_first:
            self.lm_head = nn.Identity()  # a placeholder that fixes the head's place in module order
        self.transformer = nn.ModuleDict(dict(
            wte=mnn.Embedding(cfg.vocab, cfg.embed, axes=("vocab", "embed"), init_std=0.02, device=device),
            wpe=mnn.Embedding(cfg.block_size, cfg.embed, axes=(None, "embed"), init_std=0.02, device=device),
            h=nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers)),
            ln_f=_norm(cfg, device),
        ))
        self.lm_head = mnn.Linear(cfg.embed, cfg.vocab, bias=False, axes=("embed", "vocab"), init_std=0.02,
                                  device=device)
        if cfg.tied:
            self.transformer.wte.weight = self.lm_head.weight
        if torch.device(device or "cpu").type != "meta":
            meshlm.init_params(self, seed)

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        x = meshlm.constrain(x, ("batch", "seq", "embed"))
        for block in self.transformer.h:
            x = block(x)
        x = meshlm.constrain(self.transformer.ln_f(x), ("batch", None, "embed"))
        logits = meshlm.constrain(self.lm_head(x), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


@dataclass(frozen=True)
class GPTBuild:
    cfg: GPTConfig = GPTConfig()

    def __call__(self, device: str, seed: int) -> nn.Module:
        return GPT(self.cfg, device=device, seed=seed)


BATCHES = TokenBatches(vocab=GPTConfig.vocab, batch=8, seq=16)


def _two_rank_mesh(layout: str) -> str:
    """The 2-rank mesh a layout is tested on: over cp if it uses cp, else over tp if it uses tp, else over fsdp if it
    stores parameters sharded over fsdp, else over dp."""
    lay = load_layout(layout)
    if "cp" in lay.mesh_axes_used():
        return "cp=2"  # context parallel: the sequence split, attention over cp (docs/cp.md)
    if "tp" in lay.mesh_axes_used():
        return "tp=2"
    return "fsdp=2" if any("fsdp" in v for v in lay.params.values()) else "dp=2"


# pipeline layouts (layers: pp) are tested on pp meshes in tests/dist/test_pipeline.py
# scoped layouts (vlm_fsdp_tp) name submodules of a vision-language model: tests/dist/test_vlm.py
LAYOUTS_2 = [(lay, _two_rank_mesh(lay)) for lay in shipped_layouts()
             if not is_pipelined(load_layout(lay)) and not load_layout(lay).scopes]
# a covering set for this model: one layout per way its modules are split on 2 ranks (whole, fsdp,
# tp, tp with sp, cp; zero2's sharded gradients); on 2 ranks the others are one of these
# (fsdp_tp and fsdp_tp_ep are tp, hsdp and fsdp_ep fsdp, ...), and every shipped layout meets a
# user model in tests/dist/test_user_model.py and tests/dist/test_hf_gpt2.py
COVERING = {"ddp", "fsdp", "tp", "tp_sp", "fsdp_cp", "zero2"}
GPT_LAYOUTS = [(lay, mesh) for lay, mesh in LAYOUTS_2 if lay in COVERING]


_ok = assert_parity


@pytest.mark.parametrize("layout,mesh", GPT_LAYOUTS, ids=[f"{lay}-{m}" for lay, m in GPT_LAYOUTS])
def test_gpt2_matches_one_device(pool2, layout, mesh):
    _ok(pool2.run(check_training, layout, mesh, build=GPTBuild(), batches=BATCHES))


def test_gpt2_matches_one_device_2d(pool4):
    _ok(pool4.run(check_training, "fsdp_tp_sp", "fsdp=2,tp=2", build=GPTBuild(), batches=BATCHES, optims=("sgd",)))


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("tp_sp", "tp=2")])
def test_gpt_variant_untied_rmsnorm_dropout(pool2, layout, mesh):
    """Untied head, RMSNorm (torch's, through meshlm.nn), meshlm.nn.Dropout: SGD only."""
    cfg = GPTConfig(tied=False, norm="rms", dropout=0.1)
    _ok(pool2.run(check_training, layout, mesh, build=GPTBuild(cfg), batches=BATCHES, optims=("sgd",)))


def test_the_models_own_axis_mapped_by_a_layout(pool2, tmp_path):
    """A layout that shards the model's own ``qkv`` axis over tp, next to tp's usual rules."""
    tp = load_layout("tp")
    text = "params:\n  qkv: tp\n" + "".join(f"  {k}: {list(v)}\n" for k, v in tp.params.items())
    text += "compute:\n  qkv: tp\n" + "".join(f"  {k}: {list(v)}\n" for k, v in tp.compute.items())
    path = tmp_path / "tp_qkv.yaml"
    path.write_text(text)
    _ok(pool2.run(check_training, str(path), "tp=2", build=GPTBuild(), batches=BATCHES, optims=("sgd",)))


def _tie_job(layout: str, mesh_shape: str):
    """The tie, lowered: one Parameter in both slots, one optimizer entry, both state_dict
    keys, and its gradient the sum of the gradients of both uses, which the untied model
    with the same weights has separately."""
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(GPT(GPTConfig(), device="meta"), layout, mesh, seed=0)
    wte, head = model.transformer.wte, model.lm_head
    assert wte._parameters["weight"] is head._parameters["weight"]
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(model.state_dict())
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    n_params = len(list(model.parameters()))
    assert len(opt.masters()) == n_params == len(list(GPT(GPTConfig(tied=False), device="meta").parameters())) - 1
    (x, y), _ = BATCHES(1, 0)
    model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh)).backward()
    got = dict(model.named_parameters())["transformer.wte.weight"].grad.full_tensor()
    untied = GPT(GPTConfig(tied=False), seed=0)
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.transformer.wte.weight)
    untied(x, y).backward()
    want = untied.transformer.wte.weight.grad + untied.lm_head.weight.grad
    embed_only = untied.transformer.wte.weight.grad
    from harness import tolerances as tol

    torch.testing.assert_close(got, want, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * float(want.abs().max()))
    return float((got - embed_only).abs().max())


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2")])
def test_tied_head_is_one_parameter_with_the_sum_of_both_gradients(pool2, layout, mesh):
    for head_part in pool2.run(_tie_job, layout, mesh):
        assert head_part > 0  # the head's use contributes: the sum is not the embedding's gradient alone


def _init_job(layout: str, mesh_shape: str):
    """The names of the parameters whose sharded initialisation from a seed differs from
    the one-device one (NOTE [ties]: every slot of the tie draws, its first slot's draw is
    kept), for a tie whose other slot (the embedding) comes before the blocks."""
    cfg = GPTConfig(head_first=True)
    model = meshlm.shard(GPT(cfg, device="meta"), layout, meshlm.make_mesh(mesh_shape), seed=3)
    ref = dict(GPT(cfg, seed=3).named_parameters())
    got = meshlm.full_state_dict(model)
    assert set(got) == set(ref) and "lm_head.weight" in got
    return sorted(n for n in ref if not torch.equal(got[n], ref[n]))


def test_sharded_init_of_a_tie_before_the_blocks(pool2):
    for bad in pool2.run(_init_job, "fsdp", "fsdp=2"):
        assert bad == [], bad


def _constrain_typo_job():
    class Typo(GPT):
        def forward(self, idx, targets):
            return super().forward(meshlm.constrain(idx, ("batch", "sequence")), targets)

    mesh = meshlm.make_mesh("tp=2")
    model = meshlm.shard(Typo(GPTConfig(), device="meta"), "tp", mesh)
    (x, y), _ = BATCHES(1, 0)
    model(meshlm.shard_batch(x, "tp", mesh), meshlm.shard_batch(y, "tp", mesh))


def test_a_typo_in_a_constraint_is_caught_when_the_model_runs(pool2):
    with pytest.raises(WorkerError) as e:
        pool2.run(_constrain_typo_job)
    msg = str(e.value)
    assert "unknown logical axis 'sequence'" in msg and "qkv" in msg, msg
