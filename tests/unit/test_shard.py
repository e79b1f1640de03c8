"""``meshlm.shard`` (``meshlm.runtime.lowering.shard``): what it attaches and swaps, in one process.

A model as a user would write it (a tied embedding and output head, a non-block submodule
with parameters, two blocks of one class) is sharded on fake process groups' meshes, and
checked: every module holding parameters gets its class swapped for one sharded class per
(class, parameter names), shared across layers and models, with the user's class as its
base; each parameter's use (compute and gradient placements, re-gathering) is what the
layout says; a tie reads through its first slot; blocks run the block runtime only where
they have something to gather; the root keeps the user's forward; every swapped class is
named ``Sharded<the user's class>`` and refuses to be pickled; the mixed
precision defaults (the reduction dtype) and overlap; ``keep``; and the errors for a model
sharded twice and a layout naming a mesh axis the DeviceMesh lacks.  The numbers these
lead to are tests/unit/test_blocks.py's, test_local_root.py's and tests/dist/'s.
"""

from __future__ import annotations

import importlib
import pickle
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import meshlm
from harness.simworld import Gain, fake_mesh
from meshlm.layout.mesh import MeshSpec
from meshlm.runtime import bucket, main_grad
from meshlm.runtime.lowering import blocks, root, shard_state
from meshlm.runtime.lowering.atuse import _AT_USE
from meshlm.runtime.lowering.shard import sharded_class

V, D, H = 16, 8, 12
R = Replicate()


class Norm(Gain):
    """A norm's weight, inside a block or outside every block."""


@meshlm.block
class Mlp(nn.Module):
    param_axes: ClassVar = {"up": ("mlp", "embed"), "down": ("embed", "mlp")}

    def __init__(self, device=None):
        super().__init__()
        self.norm = Norm(D, device)
        self.up = nn.Parameter(torch.empty(H, D, device=device))
        self.down = nn.Parameter(torch.empty(D, H, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.up, generator=gen)
        nn.init.normal_(self.down, generator=gen)

    def forward(self, x):
        return x + F.linear(F.relu(F.linear(self.norm(x), self.up)), self.down)


@meshlm.block
class Act(nn.Module):
    """A block without parameters: nothing to gather, left as written."""

    def forward(self, x):
        return F.gelu(x)


@meshlm.block
class Pair(nn.Module):
    """A block whose parameters are all its submodules'."""

    def __init__(self, device=None):
        super().__init__()
        self.a, self.b = Norm(D, device), Norm(D, device)

    def forward(self, x):
        return self.b(self.a(x))


class Head(nn.Module):
    param_axes: ClassVar = {"weight": ("vocab", "embed")}

    def __init__(self, weight):
        super().__init__()
        self.weight = weight  # the embedding's Parameter: a tie

    def forward(self, x):
        return F.linear(x, self.weight)


class Lm(nn.Module):
    param_axes: ClassVar = {"emb": ("vocab", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(V, D, device=device))
        self.act = Act()
        self.blocks = nn.ModuleList([Mlp(device), Mlp(device)])
        self.pair = Pair(device)
        self.final = Norm(D, device)
        self.head = Head(self.emb)
        self.aux = Head(self.emb)  # a second tie of the embedding

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)

    def forward(self, tokens, targets):
        x = self.act(meshlm.constrain(F.embedding(tokens, self.emb), ("batch", "seq", "embed")))
        for b in self.blocks:
            x = b(x)
        x = self.final(self.pair(x))
        return F.cross_entropy((self.head(x) + self.aux(x)).flatten(0, 1), targets.flatten())


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def at_use_args(key):
    """What the at-use op of ``key`` is given: (compute, grads, dtype, reduce dtype,
    re-gather, grad dtype)."""
    return _AT_USE[key]


def _sharded(layout="fsdp", shape=None, **kw):
    mesh = fake_mesh(shape or {"fsdp": 2})
    return meshlm.shard(Lm(device="meta"), layout, mesh, **kw), mesh


def test_sharding_twice_is_an_error():
    model, mesh = _sharded()
    with pytest.raises(
        meshlm.MeshlmError, match="^this model is already sharded; build a fresh model to shard it again$"
    ):
        meshlm.shard(model, "fsdp", mesh)


def test_a_root_marked_as_a_block_is_an_error():
    """It used to recurse until Python's limit on the first forward."""

    @meshlm.block
    class Root(nn.Module):
        param_axes: ClassVar = {"w": ("embed", "mlp")}

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            return x @ self.w

    with pytest.raises(meshlm.MeshlmError, match=r"root module \(Root\) is marked @meshlm.block.*remove @meshlm.block"):
        meshlm.shard(Root(), "fsdp", fake_mesh({"fsdp": 2}))


def test_a_layout_axis_missing_from_the_device_mesh_is_an_error():
    """A DeviceMesh made by meshlm for {dp: 2, fsdp: 2} whose dims lost the dp name (a
    sub-mesh, say): the layout's dp must not be silently dropped."""
    mesh = fake_mesh({"fsdp": 2})
    mesh._meshlm_spec = MeshSpec((("dp", 2), ("fsdp", 2)))
    with pytest.raises(meshlm.LayoutError, match="mesh axis 'dp' is not a dim of this DeviceMesh"):
        meshlm.shard(Lm(device="meta"), "fsdp", mesh)
    mesh._meshlm_spec = MeshSpec((("dp", 1), ("fsdp", 2)))  # of size 1: nothing to split
    meshlm.shard(Lm(device="meta"), "fsdp", mesh)


@pytest.mark.parametrize(
    "kw,want",
    [
        ({}, None),
        ({"compute_dtype": torch.bfloat16}, torch.float32),
        ({"param_dtype": torch.bfloat16}, torch.float32),
        ({"param_dtype": torch.float16, "compute_dtype": torch.float16}, torch.float32),
        ({"compute_dtype": torch.float32}, None),
        ({"compute_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}, torch.bfloat16),
        ({"reduce_dtype": torch.float64}, torch.float64),
    ],
)
def test_reduce_dtype_default(kw, want):
    model, _ = _sharded(**kw)
    st = shard_state(model)
    assert st.reduce_dtype == want
    assert st.compute_dtype == kw.get("compute_dtype")
    assert bucket.BUCKETS[model.blocks[0]._meshlm_block.key].reduce_dtype == want


@pytest.mark.parametrize("overlap,want", [(None, False), (True, True), (False, False), (1, True)])
def test_overlap_is_off_on_cpu_unless_asked(overlap, want):
    model, _ = _sharded(overlap=overlap)
    assert shard_state(model).overlap is want
    assert bucket.BUCKETS[model.blocks[0]._meshlm_block.key].overlap is want


# (layout, a weight's compute, its gradient's placements, re-gathered in backward), on {fsdp: 2}
USES = [
    ("fsdp", (R,), (Shard(1),), True),
    ("zero2", (R,), (Shard(1),), False),
    ("ddp", (R,), (R,), False),
    ("zero1", (R,), None, False),  # gradients kept local until the optimizer (no layout ``grads``)
]


@pytest.mark.parametrize("layout,compute,grads,regather", USES)
def test_every_parameter_holding_module_is_swapped(layout, compute, grads, regather):
    model, _ = _sharded(layout)
    st = shard_state(model)
    b0, b1 = model.blocks
    for m, names in [(b0, ("up", "down")), (b0.norm, ("gain",)), (model.final, ("gain",)), (model, ("emb",))]:
        assert set(m._meshlm_use) == set(names)
        assert m._meshlm_now == {} and m._meshlm_state is st
    assert type(b0.norm) is type(b1.norm) is type(model.final)  # one sharded class per (class, names)
    assert type(b0.norm).__mro__[1] is Norm and type(b0.norm).__name__ == "ShardedNorm"
    up = b0._meshlm_use["up"]  # ("mlp", "embed"): embed is its dim 1
    assert up.compute == compute and up.grads == grads and up.regather is regather
    assert b0._meshlm_use["up"].key == b1._meshlm_use["up"].key  # one at-use op for like parameters
    for head in (model.head, model.aux):
        assert head._meshlm_tied == {"weight": (model, "emb")}
        assert head._meshlm_use == {}
        assert head._parameters["weight"] is model._parameters["emb"]  # one stored shard
        assert head.weight.placements == model.emb.placements
        assert torch.equal(head.weight.to_local(), model.emb.to_local())
    # read through the first slot: a new embedding (a load) is the heads' too
    with torch.no_grad():
        model._parameters["emb"] = nn.Parameter(model._parameters["emb"] * 2)
    for head in (model.head, model.aux):
        assert torch.equal(head.weight.to_local(), model.emb.to_local())
    # what each parameter's at-use op is given (it moves the parameter on the DTensor path)
    for m in (b0, b0.norm, model):
        for use in m._meshlm_use.values():
            assert at_use_args(use.key) == (use.compute, use.grads, None, None, use.regather, None)


def test_blocks_and_the_root():
    model, _ = _sharded()
    b0, b1 = model.blocks
    assert type(b0) is type(b1)
    assert type(b0).__mro__[1] is Mlp  # one subclass of the user's class, not two
    assert type(b0).forward is blocks.block_forward
    assert type(b0).__name__ == "ShardedMlp" and type(b0).__qualname__ == "ShardedMlp"
    assert type(b0).__module__ == Mlp.__module__
    assert b0._meshlm_state is shard_state(model)
    assert type(model).__name__ == "ShardedLm" and type(model).__module__ == Lm.__module__
    assert repr(model).startswith("ShardedLm(") and "(blocks): ModuleList(\n    (0-1): 2 x ShardedMlp(" in repr(model)
    with pytest.raises(meshlm.MeshlmError, match="meshlm.unshard"):
        pickle.dumps(model.final)
    assert type(model).__mro__[1] is not Lm and Lm in type(model).__mro__
    assert type(model).forward is root.root_forward
    assert model._meshlm_orig_forward is type(model).__mro__[1].forward
    assert shard_state(model).root is not None
    assert type(model.act) is Act and not hasattr(model.act, "_meshlm_block")
    assert type(model.pair).__mro__[1] is Pair and type(model.pair).forward is blocks.block_forward
    assert type(model.final) is sharded_class(Norm, ("gain",), False)
    assert not hasattr(model.pair, "_meshlm_use") and model.pair.b.gain.placements == (R,)


@pytest.mark.parametrize("layout,calls", [("fsdp", 3), ("ddp", 0), ("zero2", 0)])
def test_the_compile_conduit_is_allowed_only_for_regathering_buckets(monkeypatch, layout, calls):
    """Dynamo's side effects under checkpoint are allowed (``allow_conduit_under_checkpoint``,
    a process-wide setting) only when a block both re-gathers and has a bucket: under fsdp
    (two Mlp and the Pair), never under a layout that keeps parameters whole."""
    shard_mod = importlib.import_module("meshlm.runtime.lowering.shard")  # the module: the package exports the function
    seen = []
    monkeypatch.setattr(shard_mod, "allow_conduit_under_checkpoint", lambda: seen.append(1))
    _sharded(layout, {"dp": 2} if layout == "ddp" else {"fsdp": 2})
    assert len(seen) == calls


def test_a_seeded_meta_model_is_one_devices_init():
    """The default: a meta model is initialised from seed 0, as ``init_params(model, 0)``."""
    want = Lm()
    meshlm.init_params(want, 0)
    model, _ = _sharded("ddp", {"dp": 2})
    got = {n: p.to_local() for n, p in model.named_parameters()}
    for n, p in want.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_init_false_draws_nothing(monkeypatch):
    """``init=False`` (the shards are about to be loaded into): no ``init_weights`` runs, and
    every shard is still allocated, of its local shape."""
    calls = []
    for cls in (Lm, Mlp, Norm):
        monkeypatch.setattr(cls, "init_weights", lambda self, gen, cls=cls: calls.append(cls.__name__))
    model, _ = _sharded(init=False)
    assert calls == []
    seeded, _ = _sharded()
    assert sorted(set(calls)) == ["Lm", "Mlp", "Norm"]  # the spies see a seeded shard's draws
    want = {n: p.to_local().shape for n, p in seeded.named_parameters()}
    assert {n: p.to_local().shape for n, p in model.named_parameters()} == want
    assert not any(p.to_local().is_meta for p in model.parameters())


def test_mixed_precision_state():
    """bf16 storage and compute with float32 gradient accumulation (ZeRO-1/2's mixed
    precision): the state, the buckets and the at-use ops carry the float32 grad dtype, the
    model's logical axes are known, and each parameter keeps its float32 initial weights."""
    model, _ = _sharded("zero2", param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16, grad_dtype=torch.float32)
    st = shard_state(model)
    assert st.grad_dtype == torch.float32 and st.reduce_dtype == torch.float32
    assert bucket.BUCKETS[model.blocks[0]._meshlm_block.key].grad_dtype == torch.float32
    assert at_use_args(model._meshlm_use["emb"].key)[2:] == (torch.bfloat16, torch.float32, False, torch.float32)
    assert {"vocab", "embed", "mlp"} <= st.vocab
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert getattr(p, main_grad.INIT_MASTER).dtype == torch.float32, n


def test_a_model_without_blocks_and_buckets_off_runs_under_dtensor():
    mesh = fake_mesh({"dp": 2})
    model = meshlm.shard(Norm(D, device="meta"), "ddp", mesh, bucket=False)
    assert shard_state(model).root is None
    mesh = fake_mesh({"dp": 2})
    model = meshlm.shard(Norm(D, device="meta"), "ddp", mesh)
    assert shard_state(model).root is not None


def test_sharded_class_of_a_nested_class():
    class Local(nn.Module):
        pass

    a = sharded_class(Local, (), False)
    assert a.__name__ == "ShardedLocal" and a.__qualname__.endswith("<locals>.ShardedLocal")
    assert a.__qualname__.removesuffix("ShardedLocal") == Local.__qualname__.removesuffix("Local")


def test_without_buckets_the_root_runs_under_dtensor():
    model, _ = _sharded(bucket=False)
    assert shard_state(model).root is None
    assert model.blocks[0]._meshlm_block.key is None
    assert type(model.blocks[0]).forward is blocks.block_forward  # it still re-gathers (ZeRO-3)


def test_sharded_class_is_cached_and_keeps_the_names():
    a = sharded_class(Norm, ("gain",), False)
    assert sharded_class(Norm, ("gain",), False) is a
    assert sharded_class(Norm, ("gain",), True) is not a
    assert sharded_class(Norm, ("gain",), False, ("x",)) is not a
    assert a.__name__ == a.__qualname__ == "ShardedNorm" and a.__module__ == Norm.__module__
    assert isinstance(a.__dict__["gain"], property) or callable(getattr(a.__dict__["gain"], "__get__", None))
    assert "forward" not in a.__dict__
    assert sharded_class(Norm, ("gain",), True).__dict__["forward"] is blocks.block_forward


def test_keep_holds_only_the_named_parameters():
    keep = {"blocks.0.up", "blocks.0.down", "blocks.0.norm.gain"}
    model, _ = _sharded(keep=keep)
    assert set(shard_state(model).plans) == keep
    assert {n for n, _ in model.named_parameters()} == keep
