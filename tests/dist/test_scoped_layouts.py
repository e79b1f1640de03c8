"""Scoped layouts (NOTE [scoped layouts] in meshlm/core/scopes.py) on a two-tower model written
here, as a model author would (meshlm.nn layers, not shaped by the library): an encoder
over patch features, a projector, and a causal decoder over [projected patches, tokens].
Both towers use the standard axes (embed, heads, mlp), so only a scope can shard them
differently.  Each scoped layout must train as on one device (loss, the gradients the
optimizer steps with, parameters, optimizer state; harness.parity), and each
parameter must be stored where its scope says."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import meshlm
from meshlm import nn as mnn
from harness import dist_pool_fixture
from harness.parity import assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=90)
pool2 = dist_pool_fixture(2, timeout_s=60)


@dataclass(frozen=True)
class Cfg:
    vocab: int = 32
    feat: int = 12
    patches: int = 4
    enc: int = 16
    dec: int = 32
    heads: int = 4
    layers: int = 1


class Attn(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, device=None):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = mnn.Linear(d, 3 * d, axes=("embed", "heads"), init_std=0.05, device=device)
        self.out = mnn.Linear(d, d, axes=("heads", "embed"), init_std=0.05, device=device)

    def forward(self, x):
        b, t, d = x.shape
        h = meshlm.constrain(self.qkv(x), ("batch", None, "heads"))
        # heads-major split, so a tp shard of the fused output holds whole heads of q, k and v
        h = h.view(b, t, self.heads, 3, d // self.heads).permute(3, 0, 2, 1, 4)
        q, k, v = (meshlm.constrain(y, ("batch", "heads", None, "head_dim")) for y in h.unbind(0))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).flatten(2)
        return self.out(meshlm.constrain(y, ("batch", None, "heads")))


@meshlm.block
class Block(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, device=None):
        super().__init__()
        self.n1, self.n2 = mnn.LayerNorm(d, device=device), mnn.LayerNorm(d, device=device)
        self.attn = Attn(d, heads, causal, device)
        self.up = mnn.Linear(d, 2 * d, axes=("embed", "mlp"), init_std=0.05, device=device)
        self.down = mnn.Linear(2 * d, d, axes=("mlp", "embed"), init_std=0.05, device=device)

    def forward(self, x):
        x = meshlm.constrain(x + self.attn(self.n1(meshlm.constrain(x, ("batch", None, "embed")))),
                             ("batch", None, "embed"))
        h = meshlm.constrain(F.gelu(self.up(self.n2(x))), ("batch", None, "mlp"))
        return meshlm.constrain(x + self.down(h), ("batch", "seq", "embed"))


class Encoder(nn.Module):
    def __init__(self, c: Cfg, device=None):
        super().__init__()
        self.inp = mnn.Linear(c.feat, c.enc, axes=(None, "embed"), init_std=0.1, device=device)
        self.blocks = nn.ModuleList(Block(c.enc, c.heads, False, device) for _ in range(c.layers))

    def forward(self, images):
        x = meshlm.constrain(self.inp(images), ("batch", "patch", "embed"))
        for b in self.blocks:
            x = b(x)
        return x


class TwoTower(nn.Module):
    input_axes = {"images": ("batch", "patch", None)}

    def __init__(self, c: Cfg, device=None, seed=0):
        super().__init__()
        self.vision = Encoder(c, device)
        self.projector = nn.Sequential(
            mnn.Linear(c.enc, c.dec, axes=("embed", "mlp"), init_std=0.1, device=device),
            nn.GELU(),
            mnn.Linear(c.dec, c.dec, axes=("mlp", "embed"), init_std=0.1, device=device),
        )
        self.language = nn.ModuleDict(dict(
            emb=mnn.Embedding(c.vocab, c.dec, axes=("vocab", "embed"), init_std=0.1, device=device),
            blocks=nn.ModuleList(Block(c.dec, c.heads, True, device) for _ in range(c.layers)),
            head=mnn.Linear(c.dec, c.vocab, bias=False, axes=("embed", "vocab"), init_std=0.1, device=device),
        ))
        if torch.device(device or "cpu").type != "meta":
            meshlm.init_params(self, seed)

    def forward(self, tokens, labels, images):
        img = meshlm.constrain(self.projector(self.vision(images)), ("batch", "patch", "embed"))
        x = torch.cat([img, self.language.emb(tokens)], dim=1)
        x = meshlm.constrain(x, ("batch", "seq", "embed"))
        for b in self.language.blocks:
            x = b(x)
        logits = meshlm.constrain(self.language.head(x[:, img.shape[1]:]), ("batch", "seq", "vocab"))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@dataclass(frozen=True)
class Build:
    cfg: Cfg = Cfg()

    def __call__(self, device: str, seed: int) -> nn.Module:
        return TwoTower(self.cfg, device=device, seed=seed)


def batches(step: int, micro: int, batch: int = 8, seq: int = 8, c: Cfg = Cfg()):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, c.vocab, (batch, seq), generator=g)
    labels = torch.randint(0, c.vocab, (batch, seq), generator=g)
    images = torch.randn(batch, c.patches, c.feat, generator=g)
    return (tokens, labels, images), {}


def no_images_on_rank0(step: int, micro: int):
    (t, y, im), kw = batches(step, micro)
    im[: im.shape[0] // 2] = 0.0
    return (t, y, im), kw


INPUT_AXES = {2: ("batch", "patch", None)}

SCOPED = """\
params: {embed: fsdp, heads: tp, mlp: tp, vocab: tp}
compute: {batch: [dp, fsdp], heads: tp, mlp: tp, vocab: tp}
scopes:
  vision: {vision}
"""


def _layout(tmp_path, vision: str) -> str:
    p = tmp_path / f"scoped_{abs(hash(vision))}.yaml"
    p.write_text(SCOPED.replace("{vision}", vision))
    return str(p)


_ok = assert_parity


@pytest.mark.parametrize("vision", ["ddp", "single", "fsdp", "fsdp_tp", "{params: {embed: fsdp}}"])
def test_scoped_two_tower_matches_one_device(pool4, tmp_path, vision):
    """The encoder replicated, ZeRO-3, ZeRO-3 + tensor parallel, or inline; the rest fsdp x tp."""
    lay = _layout(tmp_path, vision)
    _ok(pool4.run(check_training, lay, "fsdp=2,tp=2", build=Build(), batches=batches, input_axes=INPUT_AXES,
                  optims=("sgd",)))


def _placements(layout: str):
    mesh = meshlm.make_mesh("fsdp=2,tp=2")
    model = meshlm.shard(TwoTower(Cfg(), device="meta"), layout, mesh, seed=0)
    return {n: tuple(p.placements) for n, p in model.named_parameters()}


def test_each_scope_stores_its_parameters_its_way(pool4, tmp_path):
    r = Replicate()
    pl = pool4.run(_placements, _layout(tmp_path, "single"))[0]
    assert pl["vision.blocks.0.up.weight"] == (r, r)
    assert pl["vision.inp.weight"] == (r, r)
    assert pl["language.blocks.0.up.weight"] == (Shard(1), Shard(0))  # (mlp, embed): embed over fsdp, mlp over tp
    assert pl["projector.0.weight"] == (Shard(1), Shard(0))  # outside every scope: the top level's rules
    pl = pool4.run(_placements, _layout(tmp_path, "fsdp"))[0]
    assert pl["vision.blocks.0.up.weight"] == (Shard(1), r)  # embed over fsdp only


def test_text_only_ranks_still_run_the_encoder(pool2, tmp_path):
    """Rows without an image (zeros here) on a whole rank: the step finishes and matches."""
    _ok(pool2.run(check_training, _layout(tmp_path, "single"), "fsdp=2", build=Build(), batches=no_images_on_rank0,
                  input_axes=INPUT_AXES, optims=("sgd",)))


def _activations(layout: str, compile: bool = False):
    """The placements of each tower's block output in one forward."""
    mesh = meshlm.make_mesh("fsdp=2,tp=2")
    model = meshlm.shard(TwoTower(Cfg(), device="meta"), layout, mesh, seed=0)
    if compile:
        from meshlm.runtime.compile import compile_blocks

        compile_blocks(model, "aot_eager")
    seen = {}
    for name in ("vision", "language"):
        blk = model.get_submodule(f"{name}.blocks.0")
        blk.register_forward_hook(lambda _m, _a, out, name=name: seen.update({name: tuple(out.placements)}))
    (t, y, im), _ = batches(0, 0)
    model(meshlm.shard_batch(t, layout, mesh), meshlm.shard_batch(y, layout, mesh),
          meshlm.shard_batch(im, layout, mesh)).backward()
    return seen


def test_activations_inside_a_scope_follow_its_compute_rules(pool4, tmp_path):
    """Under `vision: single` the encoder computes on the whole batch (replicated), while
    the decoder's activations stay batch-sharded over fsdp: the scope's constrain handler."""
    r = Replicate()
    seen = pool4.run(_activations, _layout(tmp_path, "single"))[0]
    assert seen == {"vision": (r, r), "language": (Shard(0), r)}
    seen = pool4.run(_activations, _layout(tmp_path, "fsdp"))[0]
    assert seen == {"vision": (Shard(0), r), "language": (Shard(0), r)}
    seen = pool4.run(_activations, _layout(tmp_path, "single"), True)[0]  # compiled blocks: the same
    assert seen == {"vision": (r, r), "language": (Shard(0), r)}
