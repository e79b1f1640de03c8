"""Parity of every shipped layout against one device: three optimizer steps, each over two
accumulated micro-batches, with SGD (momentum) and AdamW, checked on the loss, the gradient
each optimizer steps with, the parameters, the masters and the optimizer state.  AdamW
runs on every layout on 2 and in bf16; the cases on 4 step with SGD alone (the gradient
scale shows there, and AdamW's step is elementwise on each shard whatever the mesh).

Meshes of 2 and 4 gloo processes, 1-D and 2-D; every layout eager on 2 and under
torch.compile (aot_eager per block, SGD; COMPILED), eager on 4 too (EAGER_4 and the cases
after it), inductor for one; the overlapped reduction; bf16
mixed precision as ``meshlm train`` runs it (ddp, zero1, zero2, fsdp, tp; overlapped too)
against the same recipe in plain torch.  The checks run inside the workers
(harness.parity.check_training); tolerances and their derivation are in
meshlm/train/tolerances.py (NOTE [tolerances after steps], NOTE [mixed-precision parity]).
"""

from typing import ClassVar

import pytest
import torch
from torch import nn

import meshlm

from harness import WorkerError, dist_pool_fixture
from harness.parity import LlamaBuild, TokenBatches, check_training

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

EAGER_2 = [
    ("single", "dp=2"), ("ddp", "dp=2"), ("zero1", "dp=2"), ("zero2", "fsdp=2"), ("fsdp", "fsdp=2"),
    ("hsdp", "fsdp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"), ("fsdp_tp", "fsdp=2"), ("fsdp_tp_sp", "tp=2"),
]
# Eager on 4: 2-D meshes and 1-D meshes of 4 (ddp, zero2, hsdp, tp on tp=4, fsdp_tp and
# fsdp_tp_sp run eager on 4 in OVERLAP_4, the tied embeddings, the ignored targets, the class
# submesh or bf16).
EAGER_4 = [
    ("zero1", "dp=2,fsdp=2"), ("fsdp", "fsdp=4"), ("fsdp", "dp=2,fsdp=2"), ("tp", "dp=2,tp=2"), ("tp_sp", "tp=4"),
    ("tp_sp", "fsdp=2,tp=2"),
]
# Compiled: the 1-D layouts on 2 (a 1-D mesh of 4 compiles the graph a 1-D mesh of 2 does;
# test_parity_compiled_body_eager_comms compiles on 1-D meshes of 4), the 2-D ones on 4.
COMPILED = [
    ("single", "dp=2"), ("ddp", "dp=2"), ("zero1", "dp=2"), ("zero2", "dp=2"), ("fsdp", "fsdp=2"),
    ("hsdp", "dp=2,fsdp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"), ("fsdp_tp", "fsdp=2,tp=2"),
    ("fsdp_tp_sp", "fsdp=2,tp=2"),
]
# The overlapped reduction (NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py; the default on
# CUDA): all-reduce, reduce-scatter, both (hsdp), and with tp.
OVERLAP_4 = [("ddp", "dp=4"), ("zero2", "dp=4"), ("hsdp", "dp=2,fsdp=2"), ("fsdp_tp_sp", "fsdp=2,tp=2")]


def _ids(cases):
    return [f"{l}-{m}" for l, m in cases]


def _local_root(layout: str, mesh: str) -> bool:
    """Whether the root runs on local tensors (NOTE [local root] in meshlm/runtime/lowering/local_root.py): on one
    device, or where the layout splits the batch over every mesh axis of size > 1 and those
    are all data axes
    (every shipped layout but single puts the batch on dp and fsdp; tp layouts on a mesh
    whose tp is 1 are data parallel there)."""
    axes = {a: int(n) for a, n in (kv.split("=") for kv in mesh.split(","))}
    if all(n == 1 for n in axes.values()):
        return True  # one device: every layout's math is the one-device math
    return layout != "single" and all(a in ("dp", "fsdp") for a, n in axes.items() if n > 1)


def _ok(res, layout=None, mesh=None):
    """The workers' reports: every rank saw the same losses, and (given the layout) every
    sharded forward ran on a local root where one applies, and under DTensor elsewhere."""
    assert all(r["loss"] == res[0]["loss"] for r in res), "ranks disagree on the loss"
    for r in res:
        for name, worst in r["worst"].items():
            assert set(worst) >= {"loss", "grad", "param"} and all(v <= 1.0 for v in worst.values()), (name, worst)
    if layout is not None:
        forwards = sum(len(v) for v in res[0]["loss"].values())
        local = _local_root(layout, mesh)
        want = {"local": forwards if local else 0, "dtensor": 0 if local else forwards}
        assert all(r["root"] == want for r in res), f"{layout}: root runs {[r['root'] for r in res]}, expected {want}"


@pytest.mark.parametrize("compile", [None, "aot_eager"])
@pytest.mark.parametrize("layout", ["single", "fsdp", "tp_sp"])
def test_parity_one_device(pool1, layout, compile):
    """On a one-device mesh every layout's blocks and root run on local tensors (NOTE
    [local blocks] in meshlm/runtime/bucket/__init__.py, NOTE [local root] in meshlm/runtime/lowering/local_root.py), eager and compiled."""
    _ok(pool1.run(check_training, layout, "dp=1", compile=compile), layout, "dp=1")


@pytest.mark.parametrize("layout,mesh", EAGER_2, ids=_ids(EAGER_2))
def test_parity_2(pool2, layout, mesh):
    _ok(pool2.run(check_training, layout, mesh), layout, mesh)


@pytest.mark.parametrize("layout,mesh", EAGER_4, ids=_ids(EAGER_4))
def test_parity_4(pool4, layout, mesh):
    """SGD (momentum) only: a mesh of 4 changes where the gradients are reduced and the
    weights gathered, which the gradient each step takes shows; AdamW's step, elementwise
    on each shard, runs on every layout on 2 (test_parity_2)."""
    _ok(pool4.run(check_training, layout, mesh, optims=("sgd",)), layout, mesh)


@pytest.mark.parametrize("layout,mesh", COMPILED, ids=_ids(COMPILED))
def test_parity_compiled_aot_eager(pool2, pool4, layout, mesh):
    """SGD (momentum) only: compiling changes the blocks' forward and backward, which the
    gradient each step takes is checked on; the optimizer step runs eager either way, and
    AdamW's runs on every layout eager above.  Two steps: the second runs the compiled
    blocks on the weights the first step moved, with momentum in the update."""
    pool = pool4 if "," in mesh else pool2
    _ok(pool.run(check_training, layout, mesh, compile="aot_eager", optims=("sgd",), steps=2), layout, mesh)


def test_parity_compiled_inductor(pool2):
    """Inductor compiles for tens of seconds on this machine: one case, SGD only (the step
    itself is eager; the AdamW step is covered above), with dropout, whose keys inductor
    draws as eager does only with fallback_random, which compile_blocks sets (NOTE [dropout
    keys] in meshlm/core/rng.py; without it the masks, and so the losses, differ)."""
    _ok(pool2.run(check_training, "tp_sp", "tp=2", compile="inductor", optims=("sgd",),
                  build=LlamaBuild(overrides=(("dropout", 0.1),))))


@pytest.mark.parametrize("layout,mesh", OVERLAP_4, ids=_ids(OVERLAP_4))
def test_parity_overlapped_reduction(pool4, layout, mesh):
    """Gradient reductions left in flight through backward (NOTE [overlapped reduction] in
    meshlm/runtime/bucket/op.py; the default on CUDA), across accumulated micro-batches, give the same
    gradients, settled as plain tensors (SGD: the step does not see how they were reduced;
    AdamW's runs on every layout in test_parity_2)."""
    _ok(pool4.run(check_training, layout, mesh, overlap=True, optims=("sgd",)), layout, mesh)


@pytest.mark.parametrize("layout,mesh,overlap", [("fsdp", "fsdp=4", True), ("zero2", "dp=4", False)])
def test_parity_compiled_body_eager_comms(pool4, layout, mesh, overlap):
    """Only the blocks' math compiled, their collectives eager around it (NOTE [compiled body]
    in meshlm/runtime/compile.py): fsdp with overlap frees, re-gathers and prefetches under compile."""
    _ok(pool4.run(check_training, layout, mesh, compile="aot_eager", comms="eager", overlap=overlap, optims=("sgd",)),
        layout, mesh)


@pytest.mark.parametrize("layout,mesh", [("tp", "tp=4"), ("fsdp_tp_sp", "fsdp=2,tp=2")])
def test_parity_tied_embeddings(pool4, layout, mesh):
    """A vocab-sharded table used by both F.embedding and the output F.linear: its gradient
    is the sum of both uses (SGD; the tie is one parameter to the optimizer, whatever it is)."""
    _ok(pool4.run(check_training, layout, mesh, build=LlamaBuild(overrides=(("tie_embeddings", True),)),
                  optims=("sgd",)))


def _bf16_init_job(layout, mesh):
    """The weights of a seed in bf16: sharded (built on meta, drawn shard by shard) and
    one-device (init_params on a bf16 model) both equal the float32 weights of that seed
    rounded to bf16.  vocab 998 x embed 20 and mlp 50 x embed 20: element counts that
    are not multiples of 16, where torch's bf16 and float32 normal_ kernels draw
    differently (on 2.13 in the tail, on 2.11 everywhere)."""
    import torch

    import meshlm
    from meshlm.models import Llama, llama_config

    cfg = llama_config("llama_tiny", vocab=998, embed=20, heads=2, kv_heads=1, mlp=50, layers=1)
    ref = {k: v.to(torch.bfloat16) for k, v in Llama(cfg, seed=3).state_dict().items()}
    sharded = meshlm.shard(Llama(cfg, device="meta").to(torch.bfloat16), layout, meshlm.make_mesh(mesh), seed=3)
    one = Llama(cfg, device="meta").to(torch.bfloat16).to_empty(device="cpu")
    meshlm.init_params(one, 3)
    got = {"sharded": meshlm.full_state_dict(sharded), "init_params": one.state_dict()}
    return {f"{src} {k}": float((sd[k].float() - v.float()).abs().max()) for src, sd in got.items()
            for k, v in ref.items() if not torch.equal(sd[k], v)}


def test_bf16_weights_of_a_seed_are_float32_rounded(pool2):
    for bad in pool2.run(_bf16_init_job, "fsdp", "fsdp=2"):
        assert bad == {}, f"bf16 weights differ from the float32 weights of the seed rounded: {bad}"


def _check_training_1d_loss_handlers(layout, mesh):
    """check_training with the vocab-parallel loss run as on torch 2.11, whose loss-parallel
    handlers take 1-D meshes only: on the class dim's submesh (NOTE [loss on the class
    submesh] in meshlm/_torch_compat/dtensor_loss.py), whatever torch runs this."""
    from torch.distributed.tensor.parallel import loss as torch_loss

    from meshlm._torch_compat import dtensor_ops as ops

    ops.install()
    saved = dict(ops._MINE)
    try:
        for op, handler in torch_loss.customized_loss_ops.items():
            ops._MINE[op] = ops._class_sharded_or_default(op, ops._on_class_submesh(handler))
        return check_training(layout, mesh, optims=("sgd",))
    finally:
        ops._MINE.update(saved)  # read at every call (dtensor_ops._dispatch): nothing to reinstall


@pytest.mark.parametrize("layout", ["fsdp_tp", "fsdp_tp_sp"])
def test_parity_loss_on_class_submesh(pool4, layout):
    """The 2.11 path of the vocab-sharded loss on a 2-D mesh (batch over fsdp, vocab over
    tp): loss and gradients equal one device's, so CI on 2.13 covers it too."""
    _ok(pool4.run(_check_training_1d_loss_handlers, layout, "fsdp=2,tp=2"))


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=4"), ("hsdp", "dp=2,fsdp=2")])
def test_parity_local_root_ignored_targets(pool4, layout, mesh):
    """A local root's loss is combined from each rank's mean and its weight (the count of
    targets not ignored): with targets ignored unevenly over the ranks, the loss and the
    gradients are still one device's (a mean of the ranks' means would not be)."""
    _ok(pool4.run(check_training, layout, mesh, batches=TokenBatches(ignored_targets=True), optims=("sgd",)),
        layout, mesh)


def _nll_sum_job():
    """An NLL sum over the rows (not the shipped model's mean): the local root lifts it by
    its autograd node, summed over the ranks, once per call (NOTE [local root] in meshlm/runtime/lowering/local_root.py)."""
    import torch.nn.functional as F

    import meshlm
    from meshlm.runtime.lowering import shard_state
    from meshlm.models import Llama, llama_config
    from harness import tolerances as tol

    class SumLoss(Llama):
        def forward(self, tokens, labels):
            logits = super().forward(tokens)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")

    cfg = llama_config("llama_tiny")
    gen = torch.Generator().manual_seed(5)
    X, Y = torch.randint(0, cfg.vocab, (4, 8), generator=gen), torch.randint(0, cfg.vocab, (4, 8), generator=gen)
    mesh = meshlm.make_mesh("dp=2")
    ref = SumLoss(cfg, seed=0)
    ref_loss = ref(X, Y)
    ref_loss.backward()
    model = meshlm.shard(SumLoss(cfg, device="meta"), "ddp", mesh)
    loss = model(meshlm.shard_batch(X, "ddp", mesh), meshlm.shard_batch(Y, "ddp", mesh))
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=tol.LOSS_RTOL, atol=0)
    for n, p in model.named_parameters():
        r = dict(ref.named_parameters())[n].grad
        torch.testing.assert_close(p.grad.full_tensor(), r, rtol=tol.GRAD_RTOL,
                                   atol=tol.GRAD_ATOL_OF_MAX * float(r.abs().max()))
    return dict(shard_state(model).roots)


def test_local_root_lifts_nll_sum(pool2):
    for r in pool2.run(_nll_sum_job):
        assert r == {"local": 1, "dtensor": 0}, r


class _Regressor(nn.Module):
    """A model meshlm did not shape: a two-layer MLP with an MSE loss, weights drawn by the
    caller.  An MSE is not an NLL, so the model says how it reduces over the batch
    (``meshlm.reduce_batch``; NOTE [local root] in meshlm/runtime/lowering/local_root.py); under DTensor its
    backward goes through NOTE [mean loss backward] in meshlm/_torch_compat/dtensor_loss.py."""

    param_axes: ClassVar[dict] = {"w_in": ("mlp", "embed"), "w_out": ("embed", "mlp")}

    def __init__(self, device: str, seed: int, features: int = 16, hidden: int = 32):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w_in = nn.Parameter((torch.randn(hidden, features, generator=gen) * 0.3).to(device))
        self.w_out = nn.Parameter((torch.randn(features, hidden, generator=gen) * 0.3).to(device))

    def forward(self, x, y):
        h = torch.nn.functional.silu(torch.nn.functional.linear(x, self.w_in))
        loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(h, self.w_out), y)
        return meshlm.reduce_batch(loss, "mean")


def _regression_batches(step: int, micro: int):
    gen = torch.Generator().manual_seed(100 * step + micro)
    return (torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)), {}


@pytest.mark.parametrize("layout,mesh", [("zero1", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2")])
def test_parity_model_meshlm_did_not_shape(pool2, layout, mesh):
    """check_training on any model: built from its own weights (from_seed=False), fed
    float features split along ("batch", None).  Found by this harness: the MSE's gradients
    came out world-size times too large (torch's DTensor backward of a mean-reduced loss
    divides by the shard's element count, NOTE [mean loss backward])."""
    res = pool2.run(check_training, layout, mesh, build=_Regressor, batches=_regression_batches, from_seed=False,
                    input_axes={0: ("batch", None), 1: ("batch", None)})
    _ok(res, layout, mesh)


def _with_bug(layout: str, mesh: str, bug: str, precision: str = "fp32"):
    """check_training (SGD, 2 steps) with ``bug`` injected into this worker only; the
    AssertionError it raises (None if none)."""
    from meshlm.runtime import main_grad
    from meshlm.runtime.lowering import local_root
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    saved = ShardedOptimizer.reduce_grads, local_root.BatchReduce.backward, main_grad._add
    kw = {}
    if bug == "zero_grad_averaged_twice":  # the ZeRO-1/2 gradient divided by the data-parallel size again
        def reduce_grads(self):
            fresh = not self._ready
            saved[0](self)
            if fresh:
                for _f, p, m in self._pairs:
                    if m is not p and m.grad is not None:
                        m.grad.div_(self.mesh.size())
        ShardedOptimizer.reduce_grads = reduce_grads
    elif bug == "loss_ignores_grad_accum":  # the local root's loss drops the 1/grad_accum of its gradient
        local_root.BatchReduce.backward = staticmethod(lambda ctx, g, *_: (torch.ones_like(g) * ctx.scale.to(g.dtype)
                                                                  if ctx.scale is not None else torch.ones_like(g),
                                                                  None, None, None))
    elif bug == "main_grad_doubled":  # NOTE [main grads]: the reduced gradient added twice
        main_grad._add = lambda p, g, dtype: saved[2](p, g * 2, dtype)
    elif bug == "main_grad_not_accumulated":  # each micro-batch's gradient replaces the last one's
        def add(p, g, dtype):
            main_grad.release(p)
            saved[2](p, g, dtype)
        main_grad._add = add
    elif bug == "reduced_in_bf16":  # the gradient reductions in bf16 instead of float32
        kw["shard_kw"] = {"reduce_dtype": torch.bfloat16}
    try:
        check_training(layout, mesh, optims=("sgd",), steps=2, precision=precision, **kw)
        return None
    except AssertionError as e:
        return str(e)
    finally:
        ShardedOptimizer.reduce_grads, local_root.BatchReduce.backward, main_grad._add = saved


@pytest.mark.parametrize("layout,bug", [("zero1", "zero_grad_averaged_twice"), ("zero2", "zero_grad_averaged_twice"),
                                        ("ddp", "loss_ignores_grad_accum")])
def test_parity_catches_gradient_scale_bugs(pool2, layout, bug):
    """The check bites, by orders of magnitude: a ZeRO-1/2 gradient averaged twice (which
    the step alone cannot show: the optimizer steps with what it is given) and a missing
    1/grad_accum (invisible without accumulation) fail on the gradient the optimizer steps
    with, thousands of times over its tolerance."""
    for msg in pool2.run(_with_bug, layout, "dp=2", bug):
        assert msg is not None and "gradient of" in msg, msg
        assert float(msg.split("exceeds its tolerance ")[1].split("x")[0]) > 1e3, msg


# Mixed precision as ``meshlm train`` runs it under train.param_dtype=bfloat16 (NOTE [mixed
# precision] in meshlm/layout/precision.py): bf16 compute over float32 storage (ddp, fsdp, tp), bf16
# storage with float32 masters and main gradients (zero1, zero2), against the same recipe in
# plain torch on one device (tests/harness/parity_mp.py; tolerances: NOTE [mixed-precision
# parity] in meshlm/train/tolerances.py).
BF16_2 = [("ddp", "dp=2"), ("zero1", "dp=2"), ("zero2", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2")]


@pytest.mark.parametrize("layout,mesh", BF16_2, ids=_ids(BF16_2))
def test_parity_bf16(pool2, layout, mesh):
    _ok(pool2.run(check_training, layout, mesh, precision="bf16"), layout, mesh)


def test_parity_bf16_2d(pool4):
    """bf16 on a 2-D mesh: tensor-parallel activations summed in bf16 across tp, gradients
    reduced in float32 across fsdp (SGD; bf16 AdamW runs on 2 in test_parity_bf16)."""
    _ok(pool4.run(check_training, "fsdp_tp", "fsdp=2,tp=2", precision="bf16", optims=("sgd",)), "fsdp_tp",
        "fsdp=2,tp=2")


@pytest.mark.parametrize("layout,mesh", [("zero2", "dp=2"), ("fsdp", "fsdp=2")])
def test_parity_bf16_overlapped_reduction(pool2, layout, mesh):
    """The overlapped reduction under bf16: zero2's float32 main gradients are added after
    backward waits for them (NOTE [main grads]), fsdp's float32 ``.grad`` as in float32."""
    _ok(pool2.run(check_training, layout, mesh, precision="bf16", overlap=True), layout, mesh)


@pytest.mark.parametrize("layout,bug,caught", [
    ("zero2", "main_grad_doubled", "gradient of"), ("zero1", "main_grad_not_accumulated", "gradient of"),
    ("zero1", "loss_ignores_grad_accum", "gradient of"), ("zero2", "reduced_in_bf16", "not in float32")])
def test_parity_bf16_catches_bugs(pool2, layout, bug, caught):
    """The bf16 check bites: a main gradient added twice, or replaced instead of accumulated
    over micro-batches, or a missing 1/grad_accum, fails the gradient check tens of times
    over its tolerance (NOTE [mixed-precision parity]: the tolerance is a few bf16 roundings
    of the largest gradient entry, these bugs move the gradient by 50-100% of itself).  A
    reduction in bf16 adds one bf16 rounding, which the numerical bound allows by
    derivation; the harness fails it on the reductions' dtype."""
    for msg in pool2.run(_with_bug, layout, "dp=2", bug, "bf16"):
        assert msg is not None and caught in msg, msg
        if caught == "gradient of":
            assert float(msg.split("exceeds its tolerance ")[1].split("x")[0]) > 10, msg


def _full_many_job(layout, mesh):
    """full_many against full_tensor one by one (NOTE [gathered at once] in
    tests/harness/recipes.py), on the weights and the ZeRO masters, stored unevenly where
    the layout allows it (vocab 998, mlp 50 over 4 ranks; tensor parallelism wants its
    compute axes divisible): equal bit for bit, and how many went through the pasting path."""
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from harness.recipes import _pasted, full, full_many

    uneven = {"vocab": 998, "embed": 20, "heads": 2, "kv_heads": 1, "mlp": 50} if "tp" not in layout else {}
    cfg = llama_config("llama_tiny", layers=1, **uneven)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, meshlm.make_mesh(mesh), seed=3)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    ts = {("param", n): p for n, p in model.named_parameters()} | {("master", n): m for n, m in opt.masters().items()}
    got = full_many(ts)
    want = {k: full(t) for k, t in ts.items()}
    assert list(got) == list(ts)
    bad = [k for k in ts if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    return bad, sum(_pasted(t) for t in ts.values())


@pytest.mark.parametrize("layout,mesh", [("fsdp", "dp=2,fsdp=2"), ("zero1", "dp=4"), ("tp", "tp=4"),
                                         ("fsdp_tp_sp", "fsdp=2,tp=2")])
def test_full_many_is_full_tensor(pool4, layout, mesh):
    for bad, pasted in pool4.run(_full_many_job, layout, mesh):
        assert bad == [], f"full_many differs from full_tensor for {bad}"
        assert pasted > 0
