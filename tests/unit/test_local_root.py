"""The local root (NOTE [local root] in meshlm/runtime/lowering/local_root.py) in one process.

The model runs under ``ddp`` on a fake process group's mesh, with its collectives made to
stand for ranks that all hold this rank's rows (``simworld.patch_replicas``: a sum is this
rank's tensor times the group's size).  The global batch is then this rank's rows repeated
once per rank, and the sharded model's loss, outputs and every gradient must be one
device's on that batch: a loss combined or a gradient scaled by the wrong count of ranks
is off by a factor of 2 or 4.  DTensor's collectives are left the fake group's no-ops, so
anything the local root wrongly left to DTensor shows too.  The multi-process tests with
different rows per rank are tests/dist/test_inputs_outputs.py; these reach the same code
in milliseconds, for the unit pass of docs/mutation.md.

The model is written as a user would: a sequence classifier whose output is chosen by
``mode`` (a loss of each kind meshlm combines, a dict with per-row and seq-first tensors,
and the outputs meshlm must refuse).
"""

from __future__ import annotations

import copy
import math
import re
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import meshlm
from harness import tolerances as tol
from harness.simworld import Gain, SimWorld, fake_mesh, make_periodic, patch_replicas
from meshlm.runtime.lowering import plan_params, shard_state
from meshlm.runtime.lowering.local_root import LocalHandler, _lift, local_rows

V, D, H, C = 24, 8, 12, 6  # vocab, width, hidden, classes
ROWS, SEQ = 4, 5  # this rank's rows


@meshlm.block
class Mix(nn.Module):
    param_axes: ClassVar = {"up": ("mlp", "embed"), "down": ("embed", "mlp")}

    def __init__(self, device=None):
        super().__init__()
        self.up = nn.Parameter(torch.empty(H, D, device=device))
        self.down = nn.Parameter(torch.empty(D, H, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.up, std=0.4, generator=gen)
        nn.init.normal_(self.down, std=0.4, generator=gen)

    def forward(self, x):
        x = meshlm.constrain(x, ("batch", "seq", "embed"))
        return x + F.linear(F.gelu(F.linear(x, self.up)), self.down)


class Scale(Gain):
    """A root parameter owned by a submodule (outside every block)."""


class Opaque:
    def __init__(self, t):
        self.t = t


class Classifier(nn.Module):
    param_axes: ClassVar = {"emb": ("vocab", "embed"), "head": ("vocab", "embed"), "bias": ("vocab",)}
    input_axes: ClassVar = {"class_weight": (None,), "target": ("batch",), "labels": ("batch",), "t": ("seq", "batch")}

    def __init__(self, mode="mean", device=None, p=0.0):
        super().__init__()
        self.mode, self.p = mode, p
        self.emb = nn.Parameter(torch.empty(V, D, device=device))
        self.mix = Mix(device)
        self.scale = Scale(D, device)
        self.head = nn.Parameter(torch.empty(C, D, device=device))
        self.bias = nn.Parameter(torch.empty(C, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)
        nn.init.normal_(self.head, std=0.5, generator=gen)
        nn.init.normal_(self.bias, std=0.5, generator=gen)

    def forward(self, tokens, labels, *, class_weight=None, target=None):
        x = self.mix(meshlm.constrain(F.embedding(tokens, self.emb), ("batch", "seq", "embed")))
        x = self.scale(x)
        x = meshlm.dropout(x, self.p, ("batch", "seq", "embed"))
        logits = F.linear(x.mean(1), self.head, self.bias)
        m = self.mode
        if m == "mean":
            return F.cross_entropy(logits, labels, ignore_index=-1)
        if m == "sum":
            return F.cross_entropy(logits, labels, ignore_index=-1, reduction="sum")
        if m == "weighted":
            return F.cross_entropy(logits, labels, weight=class_weight, ignore_index=-1)
        if m == "nll":
            return F.nll_loss(F.log_softmax(logits, -1), labels, ignore_index=-1)
        if m == "dict":
            seq_first = meshlm.constrain(x.transpose(0, 1), ("seq", "batch", "embed"))
            loss = F.cross_entropy(logits, labels, ignore_index=-1)
            return {"loss": loss, "logits": logits, "x": seq_first, "note": "text", "raw": Opaque(logits)}
        if m == "mse":
            return meshlm.reduce_batch(F.mse_loss(logits[:, 0], target), "mean")
        if m == "sse":
            return meshlm.reduce_batch(((logits[:, 0] - target) ** 2).sum(), "sum")
        # Outputs meshlm must refuse under a data-parallel layout:
        if m == "scalar":
            return F.mse_loss(logits[:, 0], target)
        if m == "number":
            return {
                "loss": F.cross_entropy(logits, labels, ignore_index=-1),
                "acc": float((logits.argmax(-1) == labels).float().mean()),
            }
        if m == "unmarked":
            return x.transpose(0, 1)
        if m == "no_batch":
            return meshlm.constrain(x.sum(0), ("seq", "embed"))
        if m == "dict_unmarked":
            return {"loss": F.cross_entropy(logits, labels, ignore_index=-1), "feats": x.transpose(0, 1)}
        if m == "ndim":
            return meshlm.constrain(logits, ("batch",)).sum()
        if m == "typo":
            return meshlm.constrain(logits, ("batch", "clases")).sum()
        if m == "bare_number":
            return logits.detach().sum().item()
        if m == "unbatched":
            return F.cross_entropy(logits[0], labels[0].clamp(min=0))
        if m == "first_row":
            return F.cross_entropy(logits[:1], labels[:1].clamp(min=0))
        raise ValueError(m)


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _inputs():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, C, (ROWS,), generator=g)
    labels[1] = -1  # ignored: the mean's weight is the count of the others
    return {
        "tokens": tokens,
        "labels": labels,
        "class_weight": torch.rand(C, generator=g) + 0.5,
        "target": torch.randn(ROWS, generator=g),
    }


def _global(inputs, world):
    """The global batch: every rank's rows (this rank's, repeated), whole inputs as they are."""
    return {k: v if k == "class_weight" else torch.cat([v] * world) for k, v in inputs.items()}


def _replica_mesh(monkeypatch, mesh_shape, rank=0):
    """A fake mesh in which this process is ``rank``, its collectives standing for replicas."""
    mesh = fake_mesh(mesh_shape, rank)
    assert dist.get_rank() == rank
    patch_replicas(monkeypatch)
    return mesh


def _sharded(monkeypatch, mode, mesh_shape, rank=0, p=0.0):
    """The model under ddp on a replica mesh in which this process is ``rank``."""
    mesh = _replica_mesh(monkeypatch, mesh_shape, rank)
    return meshlm.shard(Classifier(mode, device="meta", p=p), "ddp", mesh, seed=0), mesh.size()


def _assert_grad(got, ref, name):
    """A gradient (this rank's block of it) against one device's, within the suite's tolerance."""
    tol_abs = tol.GRAD_ATOL_OF_MAX * float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=tol.GRAD_RTOL, atol=tol_abs, msg=lambda m: f"grad of {name}: {m}")


def _reference(mode, p=0.0):
    ref = Classifier(mode, p=p)
    meshlm.init_params(ref, 0)
    return ref


MESHES = [{"dp": 2}, {"dp": 2, "fsdp": 2}]  # one group of 2; two groups, world 4


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["dp2", "dp2xfsdp2"])
@pytest.mark.parametrize("mode", ["mean", "sum", "weighted", "nll", "mse", "sse"])
def test_loss_and_every_gradient_are_one_devices(monkeypatch, mode, mesh_shape):
    model, world = _sharded(monkeypatch, mode, mesh_shape)
    ref = _reference(mode)
    inputs = _inputs()
    want = ref(**_global(inputs, world))
    want.backward()
    got = model(**inputs)
    assert shard_state(model).roots == {"local": 1, "dtensor": 0}
    assert type(got) is torch.Tensor and got.ndim == 0
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert isinstance(p.grad, DTensor) and all(isinstance(q, Replicate) for q in p.grad.placements), n
        r = refs[n].grad
        _assert_grad(p.grad.to_local(), r, n)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["dp2", "dp2xfsdp2"])
def test_dict_outputs_are_lifted_to_the_global_batch(monkeypatch, mesh_shape):
    """Per-row logits become batch-sharded DTensors of the global shape; a seq-first tensor
    marked by ``constrain`` is sharded on the dim its axes call ``batch``."""
    model, world = _sharded(monkeypatch, "dict", mesh_shape)
    inputs = _inputs()
    want = _reference("dict")(**_global(inputs, world))
    out = model(**inputs)
    torch.testing.assert_close(out["loss"].detach(), want["loss"].detach(), rtol=tol.LOSS_RTOL, atol=0)
    n_dims = len(mesh_shape)
    for key, dim in [("logits", 0), ("x", 1)]:
        t = out[key]
        assert isinstance(t, DTensor) and tuple(t.placements) == (Shard(dim),) * n_dims, (key, t)
        assert tuple(t.shape) == tuple(want[key].shape), key
        rows = want[key].narrow(dim, 0, ROWS)
        torch.testing.assert_close(t.to_local().detach(), rows.detach(), rtol=tol.GRAD_RTOL, atol=1e-6)
    # Leaves that are not tensors, and objects meshlm cannot look inside, come back as returned.
    assert out["note"] == "text" and isinstance(out["raw"], Opaque) and type(out["raw"].t) is torch.Tensor


def test_micro_batches_accumulate_and_leave_no_state_behind(monkeypatch):
    """Two forward/backward passes (gradient accumulation) sum their gradients, as on one
    device; between and after them no gathered parameter and no local-root flag is left set."""
    from meshlm.core.state import RUN

    model, world = _sharded(monkeypatch, "weighted", {"dp": 2, "fsdp": 2})
    ref = _reference("weighted")
    batches = [_inputs(), {**_inputs(), "tokens": _inputs()["tokens"].flip(0)}]
    for b in batches:
        ref(**_global(b, world)).backward()
        model(**b).backward()
        assert RUN.local_root == 0
        assert all(not getattr(m, "_meshlm_now", {}) for m in model.modules())
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        r = refs[n].grad
        _assert_grad(p.grad.to_local(), r, n)


def test_odd_rows_per_rank(monkeypatch):
    """3 rows on each of 2 ranks: the activations' global batch (6) splits evenly, so
    constrain's layout check passes (it checks the global shape, not the local one)."""
    model, world = _sharded(monkeypatch, "mean", {"dp": 2})
    inputs = {k: v if k == "class_weight" else v[:3] for k, v in _inputs().items()}
    want = _reference("mean")(**_global(inputs, world))
    torch.testing.assert_close(model(**inputs).detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_dropout_draws_the_one_device_mask_of_this_ranks_rows(monkeypatch, rank):
    """NOTE [dropout keys]: rank r's rows are rows r*ROWS.. of the global batch, and its mask
    is the one-device mask of those rows (rank 1's differs from rank 0's)."""
    model, world = _sharded(monkeypatch, "dict", {"dp": 2}, rank=rank, p=0.5)
    inputs = _inputs()
    torch.manual_seed(7)
    want = _reference("dict", p=0.5)(**_global(inputs, world))["logits"]
    torch.manual_seed(7)
    got = model(**inputs)["logits"].to_local()
    torch.testing.assert_close(got.detach(), want[rank * ROWS : (rank + 1) * ROWS].detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want[:ROWS], want[ROWS:], atol=1e-3)  # the two ranks' rows drew different masks


def test_one_device_returns_outputs_whole(monkeypatch):
    """On one device the loss comes back as the model returned it, and tensors as the
    DTensor root would return them: whole (Replicate) on the one-device mesh."""
    model, _ = _sharded(monkeypatch, "dict", {"dp": 1})
    inputs = _inputs()
    want = _reference("dict")(**inputs)
    out = model(**inputs)
    assert shard_state(model).roots == {"local": 1, "dtensor": 0}
    assert type(out["loss"]) is torch.Tensor
    torch.testing.assert_close(out["loss"].detach(), want["loss"].detach(), rtol=tol.LOSS_RTOL, atol=0)
    for key in ("logits", "x"):
        t = out[key]
        assert isinstance(t, DTensor) and all(isinstance(q, Replicate) for q in t.placements), key
        torch.testing.assert_close(t.to_local().detach(), want[key].detach(), rtol=tol.GRAD_RTOL, atol=1e-6)


@pytest.mark.parametrize(
    "mode,message",
    [
        ("scalar", "the output is a scalar computed on this rank's rows"),
        ("number", "output `acc` is a Python float"),
        ("unmarked", f"the output of shape {(SEQ, ROWS, D)} is not batch-first (dim 0 is not this rank's {ROWS}"),
        ("no_batch", "the output has logical axes ('seq', 'embed') without 'batch'"),
        ("dict_unmarked", f"output `feats` of shape {(SEQ, ROWS, D)} is not batch-first"),
        ("ndim", f"constrain: 1 logical axes ('batch',) for a tensor of 2 dims {(ROWS, C)}"),
        ("bare_number", "output `(the whole output)` is a Python float computed on this rank's rows"),
        ("unbatched", f"the output: its NLL targets do not have this rank's {ROWS} input rows"),
        ("first_row", f"the output: its NLL targets do not have this rank's {ROWS} input rows"),
    ],
)
def test_outputs_meshlm_cannot_combine_are_errors(monkeypatch, mode, message):
    model, _ = _sharded(monkeypatch, mode, {"dp": 2})
    with pytest.raises(meshlm.AnnotationError, match="^" + re.escape(message)) as e:
        model(**_inputs())
    hints = ("meshlm.reduce_batch(x, 'mean'", "through constrain(x, axes)", "give one logical axis (or None) per dim")
    assert any(h in str(e.value) for h in hints), e.value


def test_local_rows_decides_from_the_inputs(monkeypatch):
    """Rows split over every data axis, whole inputs beside them: local.  A DTensor input, or
    two inputs with different row counts: under DTensor (None)."""
    model, _ = _sharded(monkeypatch, "mean", {"dp": 2, "fsdp": 2})
    st = shard_state(model)
    x = _inputs()
    rows_pl = (Shard(0), Shard(0))
    assert local_rows(model, st, [("tokens", x["tokens"]), ("class_weight", x["class_weight"])]) == (ROWS, rows_pl)
    assert local_rows(model, st, [("class_weight", x["class_weight"])]) is None  # nothing split by rows
    assert local_rows(model, st, [("tokens", x["tokens"]), ("t", x["tokens"].T)]) is None  # batch not in dim 0
    assert local_rows(model, st, [("tokens", x["tokens"]), ("labels", x["labels"][:2])]) is None
    dt = DTensor.from_local(x["tokens"], st.mesh, rows_pl, run_check=False)
    assert local_rows(model, st, [("class_weight", x["class_weight"]), ("tokens", dt)]) is None


# ``reduce_batch`` and ``BatchReduce`` with different rows on each rank: the ranks are the
# threads of a SimWorld (plain tensors only), their mesh a stand-in with a group per dim.
class _Mesh:
    def __init__(self, sizes):
        self.sizes = sizes

    def size(self):
        return math.prod(self.sizes)

    def get_group(self, i):
        return SimpleNamespace(group_name=f"g{i}")


def _state(coord, sizes):
    """What the local root reads of a model's shard state, for the threads' ranks."""
    names = tuple(f"d{i}" for i in range(len(sizes)))
    return SimpleNamespace(names=names, sizes=dict(zip(names, sizes)), coord=coord, mesh=_Mesh(sizes))


def _handler(coord, sizes):
    return LocalHandler(_state(coord, sizes))


SIZES = (2, 2)


def _rank_rows(rank, n_classes=C):
    """Rank r's rows: r + 2 of them, some labels ignored, so the ranks' counts differ."""
    g = torch.Generator().manual_seed(11 + rank)
    n = rank + 2
    logits = torch.randn(n, n_classes, generator=g)
    labels = torch.randint(0, n_classes, (n,), generator=g)
    labels[: rank % 2 + 1] = -1
    return logits, labels


@pytest.mark.parametrize("weighted", [False, True], ids=["counts", "class-weights"])
def test_reduce_batch_of_a_mean_nll_weights_each_rank_by_its_targets(monkeypatch, weighted):
    """A mean NLL passed through reduce_batch is the global mean: each rank weighted by its
    count of targets not ignored (or their class weights), and each rank's gradient scaled
    by its share."""
    world = SimWorld(SIZES, ["g0", "g1"])
    world.patch(monkeypatch)
    cw = torch.rand(C, generator=torch.Generator().manual_seed(2)) + 0.5 if weighted else None
    rows = [_rank_rows(r) for r in range(world.world)]
    full = torch.cat([lg for lg, _ in rows]).requires_grad_()
    want = F.cross_entropy(full, torch.cat([lb for _, lb in rows]), weight=cw, ignore_index=-1)
    want.backward()

    def rank(r, coord):
        logits, labels = rows[r]
        logits = logits.clone().requires_grad_()
        out = _handler(coord, SIZES).reduce_batch(F.cross_entropy(logits, labels, weight=cw, ignore_index=-1), "mean")
        out.backward()
        return out.detach(), logits.grad

    got = world.run(rank)
    offsets = torch.tensor([0] + [lg.shape[0] for lg, _ in rows]).cumsum(0)
    for r, (loss, grad) in enumerate(got):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, full.grad[offsets[r] : offsets[r + 1]], rtol=1e-5, atol=1e-7)
        assert [s[0] for s in world.log[r]] == ["all_reduce", "all_reduce"]  # once per data axis


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_nll_output_is_combined_by_each_ranks_weight(monkeypatch, reduction):
    """A mean NLL returned by a local root is weighted by each rank's count of targets not
    ignored (ranks with different counts: the global mean, not the mean of the ranks'
    means); a sum is summed."""
    world = SimWorld(SIZES, ["g0", "g1"])
    world.patch(monkeypatch)
    rows = [_rank_rows(r) for r in range(world.world)]
    full = torch.cat([lg for lg, _ in rows]).requires_grad_()
    want = F.cross_entropy(full, torch.cat([lb for _, lb in rows]), ignore_index=-1, reduction=reduction)
    want.backward()
    offsets = torch.tensor([0] + [lg.shape[0] for lg, _ in rows]).cumsum(0)

    def rank(r, coord):
        logits, labels = rows[r]
        logits = logits.clone().requires_grad_()
        st = _state(coord, SIZES)
        loss = F.cross_entropy(logits, labels, ignore_index=-1, reduction=reduction)
        out = _lift("loss", loss, st, None, (Shard(0), Shard(0)), logits.shape[0])
        out.backward()
        return out.detach(), logits.grad

    for r, (loss, grad) in enumerate(world.run(rank)):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, full.grad[offsets[r] : offsets[r + 1]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_reduce_batch_of_a_vector_in_bf16(monkeypatch, op):
    """A per-class vector (not an NLL: every rank weighs 1) in bfloat16: combined in float32,
    returned in bfloat16; the gradient each rank gets is its share."""
    world = SimWorld(SIZES, ["g0", "g1"])
    world.patch(monkeypatch)
    vals = [
        torch.randint(-8, 9, (3,), generator=torch.Generator().manual_seed(20 + r)).to(torch.bfloat16) for r in range(4)
    ]
    want = torch.stack([v.float() for v in vals]).sum(0) / (4 if op == "mean" else 1)

    def rank(r, coord):
        x = vals[r].clone().requires_grad_()
        out = _handler(coord, SIZES).reduce_batch(x, op)
        (out.float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return out.detach(), x.grad

    for r, (out, grad) in enumerate(world.run(rank)):
        assert out.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)
        share = 0.25 if op == "mean" else 1.0
        torch.testing.assert_close(grad.float(), torch.tensor([1.0, 2.0, 3.0]) * share, rtol=0, atol=0)
        assert all(s[4] == torch.float32 for s in world.log[r]), world.log[r]


def test_reduce_batch_on_one_device_is_the_value_itself(monkeypatch):
    model, _ = _sharded(monkeypatch, "mse", {"dp": 1})
    inputs = _inputs()
    want = _reference("mse")(**inputs)
    got = model(**inputs)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)


def test_constrain_checks_its_axes_inside_a_local_root(monkeypatch):
    """The local root returns constrained tensors as they are, but the layout's rules still
    apply to the annotation: a logical axis no one declared is an error, as under DTensor."""
    model, _ = _sharded(monkeypatch, "typo", {"dp": 2})
    with pytest.raises(meshlm.MeshlmError, match="clases"):
        model(**_inputs())


def _periodic(model, layout, sizes):
    """Periodic weights (``simworld.make_periodic``) for ``layout`` on mesh ``sizes``."""
    make_periodic(model, plan_params(Classifier(device="meta"), meshlm.load_layout(layout), sizes), sizes)


@pytest.mark.parametrize(
    "layout,mesh_shape", [("fsdp", {"fsdp": 2}), ("zero2", {"fsdp": 2}), ("hsdp", {"dp": 2, "fsdp": 2})]
)
def test_sharded_storage_layouts(monkeypatch, layout, mesh_shape):
    """Layouts that store parameters sharded (gathered at use, or reduce-scattered
    gradients): the root parameters come from one-member buckets gathered at use, and each
    gradient is this rank's block of one device's."""
    ref = _reference("weighted")
    _periodic(ref, layout, mesh_shape)
    mesh = _replica_mesh(monkeypatch, mesh_shape)
    model = meshlm.shard(copy.deepcopy(ref), layout, mesh)
    inputs = _inputs()
    want = ref(**_global(inputs, mesh.size()))
    want.backward()
    got = model(**inputs)
    assert shard_state(model).roots == {"local": 1, "dtensor": 0}
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        r = refs[n].grad
        for i, q in enumerate(p.grad.placements):
            if isinstance(q, Shard):
                r = r.chunk(mesh.size(i), q.dim)[0]  # this process is rank 0: coordinate 0 everywhere
        _assert_grad(p.grad.to_local(), r, n)


class TiedHead(nn.Module):
    param_axes: ClassVar = {"weight": ("vocab", "embed")}

    def __init__(self, weight):
        super().__init__()
        self.weight = weight  # the embedding's own Parameter: a tie (NOTE [ties])

    def forward(self, x):
        return F.linear(x, self.weight)


class TiedLM(nn.Module):
    """Next-token model whose head is its embedding, read through the head's module."""

    param_axes: ClassVar = {"emb": ("vocab", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(V, D, device=device))
        self.mix = Mix(device)
        self.head = TiedHead(self.emb)

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)

    def forward(self, tokens, labels):
        x = self.mix(meshlm.constrain(F.embedding(tokens, self.emb), ("batch", "seq", "embed")))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(0, 1))


def test_a_tied_parameter_read_through_its_second_module(monkeypatch):
    """The head's ``weight`` is the embedding: read through the head's module it is the same
    gathered tensor, and its gradient is the sum of both uses, as on one device."""
    mesh = _replica_mesh(monkeypatch, {"dp": 2})
    model = meshlm.shard(TiedLM(device="meta"), "ddp", mesh, seed=0)
    ref = TiedLM()
    meshlm.init_params(ref, 0)
    g = torch.Generator().manual_seed(4)
    tokens, labels = torch.randint(0, V, (ROWS, SEQ), generator=g), torch.randint(0, V, (ROWS, SEQ), generator=g)
    want = ref(torch.cat([tokens] * 2), torch.cat([labels] * 2))
    want.backward()
    got = model(tokens, labels)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0)
    got.backward()
    grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
    assert set(grads) == {"emb", "mix.up", "mix.down"}  # the tie is one parameter
    r = ref.emb.grad
    _assert_grad(grads["emb"], r, "emb")
