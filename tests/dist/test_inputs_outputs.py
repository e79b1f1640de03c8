"""Models whose inputs and outputs are not (tokens, labels) -> loss: containers of tensors in,
dicts, non-NLL scalars and seq-first tensors out.  Every layout must give the one-device
loss and gradients, or a clear error; the model's forward runs once per call.

The models here are written as a user would, with plain torch and meshlm's annotations
only, not shaped by the library's own reference models.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

V, D, H = 32, 16, 24  # vocab, width, hidden: divisible by 2 and 4


@meshlm.block
class Mixer(nn.Module):
    param_axes: ClassVar = {"w_in": ("mlp", "embed"), "w_out": ("embed", "mlp"), "scale": ("embed",)}

    def __init__(self, device=None):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(H, D, device=device))
        self.w_out = nn.Parameter(torch.empty(D, H, device=device))
        self.scale = nn.Parameter(torch.empty(D, device=device))

    def init_weights(self, gen):
        nn.init.normal_(self.w_in, std=0.3, generator=gen)
        nn.init.normal_(self.w_out, std=0.3, generator=gen)
        nn.init.uniform_(self.scale, 0.5, 1.5, generator=gen)

    def forward(self, x):
        x = meshlm.constrain(x, ("batch", None, "embed"))
        h = meshlm.constrain(torch.tanh(F.linear(x, self.w_in)), ("batch", None, "mlp"))
        return meshlm.constrain(x + F.linear(h, self.w_out) * self.scale, ("batch", "seq", "embed"))


class Tagger(nn.Module):
    """Token tagger: embedding, two mixers, a head.  ``forward(batch)`` takes a dict."""

    param_axes: ClassVar = {"emb": ("vocab", "embed"), "head": ("vocab", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(V, D, device=device))
        self.head = nn.Parameter(torch.empty(V, D, device=device))
        self.mixers = nn.ModuleList(Mixer(device) for _ in range(2))
        self.calls = 0

    def init_weights(self, gen):
        nn.init.normal_(self.emb, generator=gen)
        nn.init.normal_(self.head, std=0.3, generator=gen)

    def body(self, tokens):
        x = meshlm.constrain(F.embedding(tokens, self.emb), ("batch", "seq", "embed"))
        for m in self.mixers:
            x = m(x)
        return meshlm.constrain(F.linear(meshlm.constrain(x, ("batch", None, "embed")), self.head),
                                ("batch", "seq", "vocab"))

    def forward(self, batch):
        self.calls += 1
        logits = self.body(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))
        return {"loss": loss, "logits": logits}


class Pair(NamedTuple):
    tokens: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    note: str = "x"


class TupleTagger(Tagger):
    def forward(self, inputs):  # a list or tuple [tokens, labels], or a Pair
        return super().forward({"tokens": inputs[0], "labels": inputs[1]})["loss"]


class DataclassTagger(Tagger):
    def forward(self, batch: Batch, *, extra=None):
        assert batch.note == "x"
        return super().forward({"tokens": batch.tokens, "labels": extra["labels"]})["loss"]


class Regressor(Tagger):
    """A mean-squared error: not an NLL, so meshlm must be told how it reduces."""

    reduce = None

    def forward(self, batch):
        self.calls += 1
        pred = self.body(batch["tokens"])[..., 0]
        loss = F.mse_loss(pred, batch["target"])
        return loss if self.reduce is None else meshlm.reduce_batch(loss, self.reduce)


class SumRegressor(Regressor):
    def forward(self, batch):
        pred = self.body(batch["tokens"])[..., 0]
        return meshlm.reduce_batch(((pred - batch["target"]) ** 2).sum(), "sum")


class SeqFirst(Tagger):
    """Returns (seq, batch, vocab) logits, marked with constrain."""

    def forward(self, tokens):
        self.calls += 1
        return meshlm.constrain(self.body(tokens).transpose(0, 1), ("seq", "batch", "vocab"))


class Unmarked(Tagger):
    def forward(self, tokens):
        return self.body(tokens).transpose(0, 1)  # seq-first, not marked: the batch dim is unknown


class Number(Tagger):
    def forward(self, batch):
        out = super().forward(batch)
        return {"loss": out["loss"], "acc": float((out["logits"].argmax(-1) == batch["labels"]).float().mean())}


class Opaque:
    def __init__(self, t):
        self.t = t


class OpaqueTagger(Tagger):
    def forward(self, batch):
        return super().forward({"tokens": batch["x"].t, "labels": batch["labels"]})


def _data(bs=8, seq=6):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (bs, seq), generator=g)
    labels = torch.randint(0, V, (bs, seq), generator=g)
    target = torch.randn(bs, seq, generator=g)
    return tokens, labels, target


def _grads_match(model, ref):
    from harness import tolerances as tol

    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g = p.grad
        assert g is not None, f"no grad for {n}"
        full = g.full_tensor() if isinstance(g, torch.distributed.tensor.DTensor) else g
        r = refp[n].grad
        torch.testing.assert_close(full, r, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * float(r.abs().max()),
                                   msg=lambda m, n=n: f"grad of {n}: {m}")


def _run(cls, layout, mesh_shape, make_inputs, pick=lambda out: out, reduce=None):
    """Forward + backward of ``cls`` sharded vs one device; returns what the checks need."""
    from meshlm.runtime.lowering import shard_state
    from harness import tolerances as tol

    tokens, labels, target = _data()
    ref = cls()
    ref.reduce = reduce
    meshlm.init_params(ref, 0)
    args, kwargs = make_inputs(tokens, labels, target)
    ref_out = ref(*args, **kwargs)
    pick(ref_out).backward()

    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(cls(device="meta"), layout, mesh, seed=0)
    model.reduce = reduce
    sargs = [meshlm.shard_batch(a, layout, mesh) for a in args]
    skw = {k: meshlm.shard_batch(v, layout, mesh) for k, v in kwargs.items()}
    out = model(*sargs, **skw)
    loss = pick(out)
    assert loss.ndim == 0 and not isinstance(loss, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(loss.detach(), pick(ref_out).detach(), rtol=tol.LOSS_RTOL, atol=0)
    loss.backward()
    _grads_match(model, ref)
    return {"calls": model.calls, "out": out, "ref_out": ref_out,
            "roots": dict(shard_state(model).roots)}


def _dict_job(layout, mesh_shape):
    r = _run(Tagger, layout, mesh_shape, lambda t, y, _z: (({"tokens": t, "labels": y},), {}),
             pick=lambda out: out["loss"])
    logits = r["out"]["logits"]
    full = logits.full_tensor() if isinstance(logits, torch.distributed.tensor.DTensor) else logits
    from harness import tolerances as tol

    torch.testing.assert_close(full, r["ref_out"]["logits"], rtol=tol.GRAD_RTOL, atol=1e-5)
    return {"calls": r["calls"], "roots": r["roots"]}


DICT_CASES = [("ddp", "dp=2"), ("zero1", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"),
              ("single", "dp=2")]


@pytest.mark.parametrize("layout,mesh", DICT_CASES, ids=[f"{a}-{b}" for a, b in DICT_CASES])
def test_dict_inputs_and_outputs(pool2, layout, mesh):
    """Tensors inside a dict argument are sharded by the input rules (before: left plain,
    so each rank's slice was taken for the whole batch and the embedding's gradient was
    never reduced); a dict output's loss and logits are one device's."""
    for r in pool2.run(_dict_job, layout, mesh):
        assert r["calls"] == 1, f"forward ran {r['calls']} times"
        local = layout in ("ddp", "zero1", "fsdp")  # pure data parallel on this mesh: NOTE [local root]
        assert r["roots"] == {"local": int(local), "dtensor": int(not local)}, r["roots"]


def _containers_job():
    out = {}
    mk_tuple = lambda t, y, _z: (((t, y),), {})  # noqa: E731
    mk_list = lambda t, y, _z: (([t, y],), {})  # noqa: E731
    mk_named = lambda t, y, _z: ((Pair(t, y),), {})  # noqa: E731
    mk_dc = lambda t, y, _z: ((Batch(t, torch.zeros_like(y)),), {"extra": {"labels": y}})  # noqa: E731
    for name, cls, mk in [("tuple", TupleTagger, mk_tuple), ("list", TupleTagger, mk_list),
                          ("namedtuple", TupleTagger, mk_named), ("dataclass", DataclassTagger, mk_dc)]:
        for layout, mesh in [("ddp", "dp=2"), ("fsdp_tp", "tp=2")]:
            out[f"{name} {layout}"] = _run(cls, layout, mesh, mk)["calls"]
    return out


def test_inputs_in_tuples_lists_namedtuples_dataclasses(pool2):
    for r in pool2.run(_containers_job):
        assert r == {k: 1 for k in r} and len(r) == 8, r


def _opaque_job():
    tokens, labels, _ = _data()
    mesh = meshlm.make_mesh("dp=2")
    model = meshlm.shard(OpaqueTagger(device="meta"), "ddp", mesh)
    batch = {"x": Opaque(meshlm.shard_batch(tokens, "ddp", mesh)), "labels": meshlm.shard_batch(labels, "ddp", mesh)}
    try:
        model(batch)
    except meshlm.AnnotationError as e:
        return str(e)
    return "no error"


def test_tensor_inside_an_opaque_object_is_an_error(pool2):
    for msg in pool2.run(_opaque_job):
        assert "input `batch.x` is a Opaque holding tensors" in msg, msg


def _regression_job(layout, mesh_shape, reduce, cls_name="Regressor"):
    cls = globals()[cls_name]
    mk = lambda t, _y, z: (({"tokens": t, "target": z},), {})  # noqa: E731
    try:
        r = _run(cls, layout, mesh_shape, mk, reduce=reduce)
    except meshlm.AnnotationError as e:
        return {"error": str(e)}
    return {"calls": r["calls"], "roots": r["roots"]}


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=4"), ("hsdp", "dp=2,fsdp=2"), ("tp", "tp=2,dp=2")])
def test_non_nll_scalar_with_reduce_batch(pool4, layout, mesh):
    """An MSE loss wrapped in reduce_batch(..., "mean") (and a sum in "sum") equals the
    one-device loss and gradients under a local root and under DTensor, running the
    forward once."""
    for r in pool4.run(_regression_job, layout, mesh, "mean"):
        assert r.get("calls") == 1, r
    for r in pool4.run(_regression_job, layout, mesh, None, "SumRegressor"):
        assert "error" not in r, r


def test_undeclared_scalar_is_an_error_not_a_rerun(pool2):
    """Before: the local root discarded the forward and ran it again under DTensor (a model
    counting its calls saw two).  Now: one run, and an error that says what to declare."""
    for r in pool2.run(_regression_job, "ddp", "dp=2", None):
        assert "meshlm.reduce_batch(x, 'mean')" in r["error"] and "the output is a scalar" in r["error"], r


def _seq_first_job():
    from harness import tolerances as tol

    tokens, _, _ = _data()
    ref = SeqFirst()
    meshlm.init_params(ref, 0)
    want = ref(tokens)
    res = {}
    for layout, mesh_shape in [("ddp", "dp=2"), ("tp", "tp=2")]:
        mesh = meshlm.make_mesh(mesh_shape)
        model = meshlm.shard(SeqFirst(device="meta"), layout, mesh)
        out = model(meshlm.shard_batch(tokens, layout, mesh))
        torch.testing.assert_close(out.full_tensor(), want, rtol=tol.GRAD_RTOL, atol=1e-5)
        res[layout] = (model.calls, [str(p) for p in out.placements])
    errors = {}
    for cls, inputs in [(Unmarked, lambda t, y: (t,)), (Number, lambda t, y: ({"tokens": t, "labels": y},))]:
        mesh = meshlm.make_mesh("dp=2")
        model = meshlm.shard(cls(device="meta"), "ddp", mesh)
        try:
            model(*[meshlm.shard_batch(a, "ddp", mesh) for a in inputs(tokens, _data()[1])])
            errors[cls.__name__] = "no error"
        except meshlm.AnnotationError as e:
            errors[cls.__name__] = str(e)
    return res, errors


def test_outputs_lifted_by_their_constrained_axes(pool2):
    for res, errors in pool2.run(_seq_first_job):
        assert res["ddp"] == (1, ["S(1)"]), res
        assert res["tp"][0] == 1, res
        assert "the output of shape (6, 4, 32) is not batch-first" in errors["Unmarked"], errors
        assert "output `acc` is a Python float" in errors["Number"], errors
