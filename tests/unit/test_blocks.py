"""The block runtime (``meshlm.runtime.lowering.blocks``) in one process.

A model written as a user would (a gated two-layer MLP stack whose block owns a
submodule's parameters, takes a keyword tensor and returns a tuple) is sharded on a fake
process group's mesh whose collectives stand for replicas (``simworld.patch_replicas``:
every rank holds this rank's rows and, with periodic weights, this rank's shard of each
parameter).  The global batch is then this rank's rows repeated once per rank, and the
sharded model's loss and every gradient must be one device's: a gradient reduced twice, a
parameter gathered from the wrong shard, a block that forgot to re-gather in backward, or
dropout drawn for the wrong rows is off, and shows.  DTensor's own collectives stay the
fake group's no-ops, so anything the block runtime wrongly left to DTensor shows too.

Checked besides the numbers: what ``block_spec`` decides per layout (bucket, members,
re-gathering, local rows), how a block re-gathers (the all-gathers issued and whether its
forward runs again in backward, for freeing, recompute, train's outer checkpoint and a
pipeline step's kept gathers), and the forward order ``link_blocks`` gives the prefetcher.
The multi-process tests with different rows per rank are tests/dist/; these reach the same
code in milliseconds, for the unit pass of docs/mutation.md.
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import meshlm
from harness import tolerances as tol
from harness.simworld import Gain, fake_mesh, make_periodic, patch_replicas
from meshlm import _torch_compat as compat
from meshlm.core.state import RUN
from meshlm.runtime import bucket
from meshlm.runtime.lowering import blocks, plan_params, shard_state
from meshlm.runtime.lowering.blocks import BlockSpec, block_spec, kept_gathers, submodule, whole_in_compute

V, D, H = 16, 8, 12  # vocab, width, hidden
ROWS, SEQ = 2, 3  # this rank's rows


class Proj(nn.Module):
    """A submodule of the block that owns parameters (bucket entries with a path)."""

    param_axes: ClassVar = {"weight": ("mlp", "embed"), "bias": ("mlp",)}

    def __init__(self, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(H, D, device=device))
        self.bias = nn.Parameter(torch.empty(H, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.weight, std=0.4, generator=gen)
        nn.init.normal_(self.bias, std=0.2, generator=gen)


@meshlm.block
class Layer(nn.Module):
    param_axes: ClassVar = {"out": ("embed", "mlp")}
    calls: ClassVar = [0]  # forwards run (recomputes included) since the last reset

    def __init__(self, device=None, p=0.0, aux=True):
        super().__init__()
        self.p, self.aux = p, aux
        self.proj = Proj(device)
        self.out = nn.Parameter(torch.empty(D, H, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.out, std=0.4, generator=gen)

    def forward(self, x, scale=1.0, *, gate=None):
        Layer.calls[0] += 1
        h = F.gelu(F.linear(x, self.proj.weight, self.proj.bias))
        if gate is not None:
            h = h * gate
        h = meshlm.dropout(h, self.p, ("batch", "seq", "mlp")) * scale
        y = x + F.linear(h, self.out)
        return (y, h.pow(2).mean(-1)) if self.aux else y


class Net(nn.Module):
    param_axes: ClassVar = {"emb": ("vocab", "embed"), "head": ("vocab", "embed")}
    input_axes: ClassVar = {"tokens": ("batch", "seq"), "targets": ("batch", "seq"), "gate": ("batch", "seq", None)}

    def __init__(self, device=None, p=0.0):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(V, D, device=device))
        self.l0 = Layer(device, p)
        self.l1 = Layer(device, p)
        self.head = nn.Parameter(torch.empty(V, D, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)
        nn.init.normal_(self.head, std=0.5, generator=gen)

    def forward(self, tokens, targets, gate):
        x = meshlm.constrain(F.embedding(tokens, self.emb), ("batch", "seq", "embed"))
        x, a0 = self.l0(x, gate=gate)
        x, a1 = self.l1(x, gate=gate)
        ce = F.cross_entropy(F.linear(x, self.head).flatten(0, 1), targets.flatten())
        return meshlm.reduce_batch(ce + 0.1 * (a0.mean() + a1.mean()), "mean")


@pytest.fixture(autouse=True)
def fake_world():
    Layer.calls[0] = 0
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, V, (ROWS, SEQ), generator=g),
        "targets": torch.randint(0, V, (ROWS, SEQ), generator=g),
        "gate": torch.rand(ROWS, SEQ, 1, generator=g) + 0.5,
    }


def _global(inputs, world):
    return {k: torch.cat([v] * world) for k, v in inputs.items()}


def _periodic(model, layout, sizes):
    """Periodic weights (``simworld.make_periodic``) for ``layout`` on mesh ``sizes``."""
    make_periodic(model, plan_params(Net(device="meta"), meshlm.load_layout(layout), sizes), sizes)


def _pair(monkeypatch, layout, mesh_shape, rank=0, p=0.0):
    """One device's model (periodic weights) and its copy sharded on a replica mesh."""
    ref = Net(p=p)
    meshlm.init_params(ref, 0)
    _periodic(ref, layout, mesh_shape)
    mesh = fake_mesh(mesh_shape, rank)
    patch_replicas(monkeypatch)
    return ref, meshlm.shard(copy.deepcopy(ref), layout, mesh), mesh


def _spy(monkeypatch, note):
    """What ``note(x, kwargs)`` gives at each call of the user's block forward (``x``: its
    first argument), read before the forward runs."""
    seen: list = []
    orig = Layer.forward

    def spy(self, x, *a, **k):
        seen.append(note(x, k))
        return orig(self, x, *a, **k)

    monkeypatch.setattr(Layer, "forward", spy)
    return seen


def _gathers(monkeypatch):
    """The all-gathers issued from now on, as (in backward) per call."""
    log: list[bool] = []
    gather = compat.all_gather_single

    def logged(t, dim, group):
        log.append(compat.in_backward())
        return gather(t, dim, group)

    monkeypatch.setattr(compat, "all_gather_single", logged)
    return log


def _local_grad(p):
    """A parameter's gradient as this rank holds it (its block of a sharded one)."""
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def _ref_block(ref_grad, placements, mesh):
    """This rank's (rank 0's) block of one device's gradient."""
    for i, q in enumerate(placements):
        if isinstance(q, Shard):
            ref_grad = ref_grad.chunk(mesh.size(i), q.dim)[0]
    return ref_grad


def _assert_grads(model, ref, mesh, scale=1.0):
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        r = refs[n].grad * scale
        if isinstance(p.grad, DTensor):
            r = _ref_block(r, p.grad.placements, mesh)
        tol_abs = tol.GRAD_ATOL_OF_MAX * float(r.abs().max())
        torch.testing.assert_close(
            _local_grad(p), r, rtol=tol.GRAD_RTOL, atol=tol_abs, msg=lambda m, n=n: f"grad of {n}: {m}"
        )


def _step(model, ref, mesh, inputs=None):
    inputs = _inputs() if inputs is None else inputs
    want = ref(**_global(inputs, mesh.size()))
    want.backward()
    Layer.calls[0] = 0  # the sharded model's forwards from here
    got = model(**inputs)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    _assert_grads(model, ref, mesh)


# ----------------------------------------------------------------------------- pure helpers


def test_submodule_walks_a_dotted_path():
    net = Net(device="meta")
    assert submodule(net, "") is net
    assert submodule(net, "l0") is net.l0
    assert submodule(net, "l1.proj") is net.l1.proj
    with pytest.raises(AttributeError):
        submodule(net, "l0.nope")


def test_whole_in_compute():
    st = type("St", (), {"names": ("dp", "tp"), "sizes": {"dp": 2, "tp": 2}})()
    one = type("St", (), {"names": ("dp", "tp"), "sizes": {"dp": 2, "tp": 1}})()

    def mem(*compute):
        return bucket.Member(compute, compute, None, (4,), (1,), torch.float32, ())

    assert whole_in_compute(mem(Replicate(), Replicate()), st)
    assert not whole_in_compute(mem(Replicate(), Shard(0)), st)
    assert not whole_in_compute(mem(Shard(0), Replicate()), st)
    assert whole_in_compute(mem(Replicate(), Shard(0)), one)  # a size-1 dim splits nothing


def _spec(regather=True, key=0):
    return BlockSpec(key, (), regather, True)


def test_frees_only_when_eager_recording_and_not_recomputing(monkeypatch):
    assert blocks._frees(_spec())
    assert not blocks._frees(_spec(regather=False))
    assert not blocks._frees(_spec(key=None))
    with torch.no_grad():
        assert not blocks._frees(_spec())
    monkeypatch.setattr(blocks, "EAGER_REGATHER", "recompute")
    assert not blocks._frees(_spec())
    monkeypatch.setattr(blocks, "EAGER_REGATHER", "free")
    monkeypatch.setattr(blocks, "eager", lambda: False)
    assert not blocks._frees(_spec())
    monkeypatch.setattr(blocks, "eager", lambda: True)
    monkeypatch.setattr(compat, "in_backward", lambda: True)
    assert not blocks._frees(_spec())


def test_kept_gathers(monkeypatch):
    m = nn.Linear(2, 2)
    assert kept_gathers(m) is None  # not sharded
    st = type("St", (), {"gathered": None})()
    m._meshlm_state = st
    assert kept_gathers(m) is None
    st.gathered = {}
    assert kept_gathers(m) is st.gathered
    monkeypatch.setattr(blocks, "eager", lambda: False)
    assert kept_gathers(m) is None  # traced code gathers at every use


# ----------------------------------------------------------------------------- block_spec

ENTRIES = (("proj", "weight"), ("proj", "bias"), ("", "out"))


@pytest.mark.parametrize(
    "layout,mesh_shape,regather",
    [
        ("ddp", {"dp": 2}, False),
        ("fsdp", {"fsdp": 2}, True),
        ("zero2", {"fsdp": 2}, False),
        ("hsdp", {"dp": 2, "fsdp": 2}, True),
    ],
)
def test_block_spec_under_data_parallel_layouts(layout, mesh_shape, regather):
    world = math.prod(mesh_shape.values())
    for rank in range(world):
        mesh = fake_mesh(mesh_shape, rank)
        model = meshlm.shard(Net(device="meta"), layout, mesh)
        spec = model.l0._meshlm_block
        assert spec.key is not None and bucket.BUCKETS[spec.key].local
        assert sorted(spec.entries) == sorted(ENTRIES)
        assert spec.regather is regather
        assert spec.local
        assert spec.rows == (rank, world)
        assert model.l1._meshlm_block is spec  # interned: every layer shares one spec
        b = bucket.BUCKETS[spec.key]
        assert b.sizes == tuple(mesh_shape[n] for n in mesh.mesh_dim_names)
        assert len(b.members) == 3


def test_block_spec_under_tensor_parallel():
    mesh = fake_mesh({"tp": 2})
    model = meshlm.shard(Net(device="meta"), "tp", mesh)
    st = shard_state(model)
    assert not hasattr(model.l0, "_meshlm_block")  # nothing to gather: the block is left as written
    assert block_spec(model.l0, st) == BlockSpec(None, (), False, False)
    mesh = fake_mesh({"fsdp": 2, "tp": 2})
    model = meshlm.shard(Net(device="meta"), "fsdp_tp", mesh)
    spec = model.l0._meshlm_block
    assert spec.key is not None and spec.regather
    assert not spec.local and spec.rows is None
    assert not bucket.BUCKETS[spec.key].local


@meshlm.block
class GainBlock(Gain):
    """A block whose one parameter is whole in compute under every shipped layout."""


def test_a_block_of_whole_parameters_runs_local_under_data_parallel_layouts_only():
    """NOTE [local blocks]: local rows only under a pure data-parallel layout, even for a
    block whose parameters are all whole in compute; and the bucket carries the mesh's data
    dims and the shard's dtypes."""
    bf16, f32 = torch.bfloat16, torch.float32
    for layout, shape, local, data_dims in (
        ("fsdp", {"fsdp": 2}, True, (0,)),
        ("fsdp_tp", {"fsdp": 2, "tp": 2}, False, (0,)),
    ):
        holder = nn.Module()
        holder.gain = GainBlock(D, device="meta")
        model = meshlm.shard(
            holder, layout, fake_mesh(shape), param_dtype=bf16, compute_dtype=bf16, reduce_dtype=f32, grad_dtype=f32
        )
        spec = model.gain._meshlm_block
        assert spec.key is not None and spec.local is local, (layout, spec)
        assert block_spec(model.gain, shard_state(model)) == spec  # buckets by default
        b = bucket.BUCKETS[spec.key]
        assert b.data_dims == data_dims and b.local is local
        assert (b.compute_dtype, b.reduce_dtype, b.grad_dtype) == (bf16, f32, f32)
        assert [m.dtype for m in b.members] == [bf16]


def test_block_spec_without_buckets():
    mesh = fake_mesh({"fsdp": 2})
    model = meshlm.shard(Net(device="meta"), "fsdp", mesh, bucket=False)
    spec = model.l0._meshlm_block
    assert spec.key is None and spec.entries == () and spec.regather and not spec.local
    mesh = fake_mesh({"dp": 2})
    model = meshlm.shard(Net(device="meta"), "ddp", mesh, bucket=False)
    assert not hasattr(model.l0, "_meshlm_block")


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "layout,mesh_shape",
    [("ddp", {"dp": 2}), ("fsdp", {"fsdp": 2}), ("zero2", {"fsdp": 2}), ("hsdp", {"dp": 2, "fsdp": 2})],
)
def test_blocks_reproduce_one_device(monkeypatch, layout, mesh_shape):
    ref, model, mesh = _pair(monkeypatch, layout, mesh_shape)
    log = _gathers(monkeypatch)
    _step(model, ref, mesh)
    regather = model.l0._meshlm_block.regather
    if layout in ("ddp", "zero2"):
        assert log == []  # parameters whole in storage: nothing to gather
    else:
        # one flat gather per block in forward (hsdp: over fsdp only), one re-gather in backward
        assert log.count(False) == 2 + 2 and log.count(True) == 2, log  # + the root's emb and head
    assert Layer.calls[0] == 2  # freeing re-gathers without running the forward again
    assert regather is (layout in ("fsdp", "hsdp"))
    # the gathered parameters were handed to the getters for the forward only
    assert [n for n, m in model.named_modules() if getattr(m, "_meshlm_now", None)] == []


@pytest.mark.parametrize("layout,mesh_shape", [("ddp", {"dp": 2}), ("fsdp", {"fsdp": 2})])
def test_a_block_given_one_tensor_runs_on_local_rows(monkeypatch, layout, mesh_shape):
    """Blocks called with one tensor (``gate=None``) under the local root: one device's
    numbers, the block's forward given this rank's rows as a plain tensor."""
    ref, model, mesh = _pair(monkeypatch, layout, mesh_shape)
    seen = _spy(monkeypatch, lambda x, k: type(x))
    inputs = dict(_inputs(), gate=None)
    want = ref(**_global({k: v for k, v in inputs.items() if v is not None}, mesh.size()), gate=None)
    want.backward()
    seen.clear()
    got = model(**inputs)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    _assert_grads(model, ref, mesh)
    assert seen and set(seen) == {torch.Tensor}, seen


def test_recompute_regathers_by_running_the_forward_again(monkeypatch):
    monkeypatch.setattr(blocks, "EAGER_REGATHER", "recompute")
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2})
    log = _gathers(monkeypatch)
    _step(model, ref, mesh)
    assert Layer.calls[0] == 4  # each block's forward once more in backward
    assert log.count(True) == 2, log


def test_under_an_outer_checkpoint_the_block_neither_frees_nor_checkpoints(monkeypatch):
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2})
    model.l0._meshlm_outer_checkpoint = True
    log = _gathers(monkeypatch)
    _step(model, ref, mesh)
    assert log.count(True) == 1, log  # only l1 re-gathers: l0 kept its parameters
    assert Layer.calls[0] == 2


def test_kept_gathers_gather_once_for_two_micro_batches(monkeypatch):
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2})
    st = shard_state(model)
    log = _gathers(monkeypatch)
    st.gathered = {}
    try:
        for seed in (5, 6):
            inputs = _inputs(seed)
            ref(**_global(inputs, mesh.size())).backward()
            model(**inputs).backward()
    finally:
        st.gathered = None
    assert log.count(True) == 0, log
    assert log.count(False) == 4, log  # l0, l1 (their buckets) and the root's two, once each
    _assert_grads(model, ref, mesh)


def test_block_on_batch_sharded_dtensors(monkeypatch):
    """Called with batch-sharded DTensors, a local block unwraps them, runs on its rows
    (dropout drawn for this rank's rows) and wraps every output back, placed as its input."""
    for rank in (0, 1):
        ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2}, rank=rank, p=0.3)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(ROWS * 2, SEQ, D, generator=g)
        gate = torch.rand(ROWS * 2, SEQ, 1, generator=g)
        torch.manual_seed(7)
        want = ref.l0(x, gate=gate)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        pl = (Shard(0),)
        torch.manual_seed(7)
        got = model.l0(DTensor.from_local(x[mine], mesh, pl), gate=DTensor.from_local(gate[mine], mesh, pl))
        assert isinstance(got, tuple) and len(got) == 2
        for o, w in zip(got, want):
            assert isinstance(o, DTensor) and o.placements == pl and o.shape == w.shape
            torch.testing.assert_close(o.to_local(), w[mine], rtol=tol.GRAD_RTOL, atol=1e-6)
        ref.l0.p = 0.0
        assert not torch.allclose(ref.l0(x, gate=gate)[0][mine], want[0][mine])  # dropout did drop


def test_block_dropout_rows_in_the_local_root(monkeypatch):
    """Under the local root each rank's dropout is drawn for its rows of the global batch:
    rank 1's outputs are one device's second half."""
    ref, model, mesh = _pair(monkeypatch, "ddp", {"dp": 2}, rank=1, p=0.3)
    seen = _spy(monkeypatch, lambda x, k: RUN.rows)
    torch.manual_seed(3)
    model(**_inputs())
    assert seen == [(1, 2), (1, 2)]


def test_link_blocks_orders_the_keyed_blocks(monkeypatch):
    mesh = fake_mesh({"fsdp": 2})
    model = meshlm.shard(Net(device="meta"), "fsdp", mesh)
    assert model.l0._meshlm_pos == 0 and model.l1._meshlm_pos == 1
    st = shard_state(model)
    order = st.prefetch.order
    assert [k for k, _ in order] == [model.l0._meshlm_block.key, model.l1._meshlm_block.key]
    stored = order[1][1]()
    assert [id(q) for q in stored] == [
        id(submodule(model.l1, p)._parameters[n]) for p, n in model.l1._meshlm_block.entries
    ]
    # read at call time: a parameter replaced later (a load) is the one the prefetch gathers
    new = nn.Parameter(model.l1.out.detach().clone())
    model.l1._parameters["out"] = new
    assert any(q is new for q in order[1][1]())


class _Matmuls(TorchDispatchMode):
    """Counts the matmul kernels run (below DTensor: the local ones)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.OPS
        return func(*args, **(kwargs or {}))


def _dt(x, mesh, pl):
    return DTensor.from_local(x, mesh, pl, run_check=False)


@pytest.mark.parametrize("outer", [False, True])
def test_one_output_one_tensor_and_a_number(monkeypatch, outer):
    """A block given one batch-sharded DTensor and a plain number (positional), keyword None,
    returning one tensor: it comes back batch-sharded; under train's outer checkpoint the
    block's forward runs once, freeing or not."""
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2})
    ref.l0.aux = model.l0.aux = False
    model.l0._meshlm_outer_checkpoint = outer
    x = torch.randn(ROWS, SEQ, D, generator=torch.Generator().manual_seed(2)).repeat(2, 1, 1)  # every rank's rows
    want = ref.l0(x, 0.5, gate=None)
    want.pow(2).sum().backward()
    log = _gathers(monkeypatch)
    Layer.calls[0] = 0
    seen = _spy(monkeypatch, lambda x, k: type(x))
    got = model.l0(_dt(x[:ROWS], mesh, (Shard(0),)), 0.5, gate=None)
    assert set(seen) == {torch.Tensor}, seen  # NOTE [local blocks]: the rows, not the DTensor
    assert isinstance(got, DTensor) and got.placements == (Shard(0),) and got.shape == want.shape
    torch.testing.assert_close(got.to_local(), want[:ROWS], rtol=tol.GRAD_RTOL, atol=1e-6)
    got.to_local().pow(2).sum().backward()
    assert Layer.calls[0] == 1
    assert log == [False] if outer else log == [False, True], log  # freed parameters re-gathered
    _assert_grads(model.l0, ref.l0, mesh)


@pytest.mark.parametrize("layout,regather", [("fsdp", "free"), ("fsdp", "recompute"), ("ddp", "free")])
def test_replicated_inputs_run_under_dtensor(monkeypatch, layout, regather):
    """Inputs that are not batch-sharded (replicated DTensors) leave the local-rows path: the
    block computes under DTensor on the whole batch, with its bucket's parameters gathered
    as DTensors, and gives one device's outputs and (every rank computing the whole batch)
    one device's gradients.  A ddp block neither frees nor recomputes; an fsdp one frees
    (its forward runs once) or, with recompute, checkpoints (twice)."""
    monkeypatch.setattr(blocks, "EAGER_REGATHER", regather)
    ref, model, mesh = _pair(monkeypatch, layout, {"dp": 2} if layout == "ddp" else {"fsdp": 2})
    g = torch.Generator().manual_seed(3)
    x, gate = torch.randn(ROWS, SEQ, D, generator=g), torch.rand(ROWS, SEQ, H, generator=g)
    want = ref.l0(x, gate=gate)
    with _Matmuls() as want_mm:
        (want[0].pow(2).sum() + want[1].sum()).backward()
    Layer.calls[0] = 0
    got = model.l0(_dt(x, mesh, (Replicate(),)), gate=_dt(gate, mesh, (Replicate(),)))
    for o, w in zip(got, want):
        assert isinstance(o, DTensor) and o.placements == (Replicate(),)
        torch.testing.assert_close(o.to_local(), w, rtol=tol.GRAD_RTOL, atol=1e-6)
    with _Matmuls() as got_mm:
        (got[0].to_local().pow(2).sum() + got[1].to_local().sum()).backward()
    assert Layer.calls[0] == (2 if layout == "fsdp" and regather == "recompute" else 1)
    # the recompute's selective policy (NOTE [re-gather in backward]) keeps the matmuls:
    # backward runs one device's matmuls, none again
    assert want_mm.n > 0 and got_mm.n == want_mm.n, (got_mm.n, want_mm.n)
    _assert_grads(model.l0, ref.l0, mesh)  # replicated, not partial: nothing to sum over ranks


def test_recompute_keeps_the_rows_for_dropout(monkeypatch):
    """A local block that re-gathers by recompute draws its recomputed dropout for this
    rank's rows (NOTE [dropout keys]): checked on rank 1, in forward and in backward."""
    monkeypatch.setattr(blocks, "EAGER_REGATHER", "recompute")
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2}, rank=1, p=0.3)
    seen = _spy(monkeypatch, lambda x, k: (RUN.rows, compat.in_backward()))
    torch.manual_seed(3)
    model(**_inputs()).backward()
    assert seen == [((1, 2), False)] * 2 + [((1, 2), True)] * 2


def test_without_buckets_a_regathering_block_runs(monkeypatch):
    """``bucket=False``: the block has no bucket but re-gathers (ZeRO-3), so its forward is
    the block runtime's, without a bucket to read.  (DTensor's collectives are the fake
    group's no-ops here: this checks the path runs and what it returns, not its values; the
    numbers are tests/dist/'s.)"""
    mesh = fake_mesh({"fsdp": 2})
    model = meshlm.shard(Net(device="meta"), "fsdp", mesh, bucket=False)
    gates = _spy(monkeypatch, lambda x, k: k.get("gate"))
    Layer.calls[0] = 0
    out = model(**_inputs())
    assert out.shape == () and Layer.calls[0] == 2
    assert len(gates) == 2 and all(g is not None for g in gates)  # the keyword reached the user's forward
    out.backward()
    assert Layer.calls[0] == 4  # checkpointed: recomputed in backward
    assert all(p.grad is not None for p in model.parameters())


def test_prefetch_under_overlap(monkeypatch):
    """With ``overlap``, each block's gather issues its neighbour's early, which that block
    then uses (NOTE [prefetch]); the numbers are unchanged."""
    ref = Net()
    meshlm.init_params(ref, 0)
    _periodic(ref, "fsdp", {"fsdp": 2})
    mesh = fake_mesh({"fsdp": 2})
    patch_replicas(monkeypatch)
    model = meshlm.shard(copy.deepcopy(ref), "fsdp", mesh, overlap=True)
    _step(model, ref, mesh)
    stats = shard_state(model).prefetch.stats
    assert stats["issued"] >= 2 and stats["used"] >= 2 and stats["stale"] == 0, stats


@pytest.mark.parametrize("comms", ["graph", "eager"])
def test_compiled_blocks(monkeypatch, comms):
    """Blocks compiled (``aot_eager``): whole with their gathers in the graph, or only
    their math (NOTE [compiled body]); one device's loss and gradients either way."""
    from meshlm.runtime.compile import compile_blocks

    torch._dynamo.reset()
    ref, model, mesh = _pair(monkeypatch, "fsdp", {"fsdp": 2})
    assert compile_blocks(model, "aot_eager", comms=comms) == 2
    bodies = []  # the compiled math's calls (comms="eager": the blocks' own forward is never run eagerly)
    for blk in (model.l0, model.l1):
        if comms == "eager":
            body = blk.__dict__["_meshlm_body"]
            blk.__dict__["_meshlm_body"] = lambda *a, body=body, **k: bodies.append(1) or body(*a, **k)
        else:
            assert "_meshlm_body" not in blk.__dict__
    _step(model, ref, mesh)
    assert len(bodies) == (2 if comms == "eager" else 0)
    if comms == "eager":  # a body compiled for local rows is not given DTensors (the DTensor path runs eagerly)
        x = torch.randn(ROWS, SEQ, D)
        model.l0(_dt(x, mesh, (Replicate(),)), gate=None)
        assert len(bodies) == 2


@pytest.mark.parametrize("layout,mesh_shape", [("ddp", {"dp": 2}), ("fsdp", {"fsdp": 2})])
def test_a_grad_dtype_equal_to_the_storage_dtype_keeps_grads_in_grad(monkeypatch, layout, mesh_shape):
    """``grad_dtype=float32`` over float32 storage is no main gradient (NOTE [main grads]):
    every gradient, the root's and the blocks', lands in ``.grad``, one device's."""
    ref = Net()
    meshlm.init_params(ref, 0)
    _periodic(ref, layout, mesh_shape)
    mesh = fake_mesh(mesh_shape)
    patch_replicas(monkeypatch)
    model = meshlm.shard(copy.deepcopy(ref), layout, mesh, grad_dtype=torch.float32)
    _step(model, ref, mesh)
    assert [n for n, p in model.named_parameters() if getattr(p, "main_grad", None) is not None] == []


@meshlm.block
class Pos(nn.Module):
    """A block called without arguments: it makes a tensor from its parameter alone."""

    param_axes: ClassVar = {"p": ("seq", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.p = nn.Parameter(torch.empty(SEQ, D, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.p, generator=gen)

    def forward(self):
        return self.p * 2.0


class PosNet(nn.Module):
    input_axes: ClassVar = {"x": ("batch", "seq", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.pos = Pos(device)

    def forward(self, x):
        return meshlm.reduce_batch((x + self.pos()).pow(2).mean(), "mean")


@pytest.mark.parametrize("layout,mesh_shape", [("ddp", {"dp": 2}), ("fsdp", {"fsdp": 2})])
def test_a_block_without_tensor_inputs_runs_in_the_local_root(monkeypatch, layout, mesh_shape):
    """A block given no tensor, inside the local root, runs on local tensors like the root
    (it gave the root a DTensor before: a raw DTensor error in the user's forward), with one
    device's loss and gradient; called outside any root it still computes under DTensor."""
    ref = PosNet()
    meshlm.init_params(ref, 0)
    make_periodic(ref, plan_params(PosNet(device="meta"), meshlm.load_layout(layout), mesh_shape), mesh_shape)
    mesh = fake_mesh(mesh_shape)
    patch_replicas(monkeypatch)
    model = meshlm.shard(copy.deepcopy(ref), layout, mesh)
    x = torch.randn(ROWS, SEQ, D, generator=torch.Generator().manual_seed(4))
    want = ref(torch.cat([x] * mesh.size()))
    want.backward()
    got = model(x)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    _assert_grads(model, ref, mesh)
    assert isinstance(model.pos(), DTensor)
