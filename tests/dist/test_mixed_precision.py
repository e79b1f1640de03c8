"""Mixed precision as ``meshlm train`` runs it (NOTE [mixed precision] in meshlm/layout/precision.py):
bf16 compute over fp32 storage, gradients reduced and accumulated in fp32; float16 with
dynamic loss scaling; the global gradient norm reduced over the mesh's own groups.

On 2 and 4 gloo processes.  Tolerances and their derivations: tests/harness/tolerances.py.
Whole bf16 training steps against the same recipe in plain torch, with accumulation, SGD
and AdamW: ``check_training(precision="bf16")`` in tests/dist/test_parity.py.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

DATA_AXES = ("dp", "fsdp")


def _train_shard_kwargs(param_dtype: str, layout: str | None = None, mesh=None) -> dict:
    """What ``meshlm train`` passes to ``meshlm.shard`` for ``train.param_dtype`` under
    ``layout`` on ``mesh`` (a dict or ``"dp=2"``; NOTE [mixed precision] in precision.py)."""
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.layout.mesh import MeshSpec
    from meshlm.app.train import shard_dtypes

    if layout is None:
        return shard_dtypes(TrainConfig(param_dtype=param_dtype))
    sizes = dict(MeshSpec.parse(mesh).axes)
    return shard_dtypes(TrainConfig(param_dtype=param_dtype), meshlm.load_layout(layout), sizes)


# --------------------------------------------------------------------------- (a) collective dtypes
def _collectives_job(layout: str, mesh_shape: dict, how: str):
    """One training step of llama_tiny in bf16 under CommCounter: every collective as
    (kind, axes, phase, dtype, device), and the gradients' dtypes.  ``how``: ``train`` (the
    dtypes ``meshlm train`` uses) or ``library`` (``shard(compute_dtype=bf16)``, the reduce
    dtype left to its default)."""
    from meshlm.runtime.comm import CommCounter
    from harness.setup import tiny_sharded

    kw = _train_shard_kwargs("bfloat16", layout, mesh_shape) if how == "train" else {"compute_dtype": torch.bfloat16}
    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=4, seq=8, **kw)
    cc = CommCounter(mesh)
    with cc:
        model(x, y).backward()
        with cc.phase("optimizer"):  # ZeRO-1 reduces at the step
            opt.reduce_grads()
    grads = sorted({str(m.grad.dtype) for m in opt.masters().values() if m.grad is not None})
    return [(c.kind, c.axes, c.phase, str(c.dtype), c.device) for c in cc.records], grads


CASES = [  # each reduction once: all-reduce over dp (ddp; hsdp's beside fsdp's), at the step
    # (zero1), reduce-scatter over dp (zero2) and over fsdp (hsdp; fsdp_tp's of tp-sharded grads)
    ("ddp", {"dp": 4}),
    ("zero1", {"dp": 4}),
    ("zero2", {"dp": 4}),
    ("hsdp", {"dp": 2, "fsdp": 2}),
    ("fsdp_tp", {"fsdp": 2, "tp": 2}),
]


@pytest.mark.parametrize("layout,mesh", CASES, ids=[c[0] for c in CASES])
def test_bf16_gradients_reduce_in_fp32(pool4, layout, mesh):
    """Under bf16 compute every gradient reduction over a data axis (backward, or the
    optimizer's for ZeRO-1) moves float32, the way ``meshlm train`` shards the model and
    the way ``shard(compute_dtype=bf16)`` does by default; parameter gathers move bf16
    (the cast comes before the gather) and the gradients the optimizer sees are float32."""
    for how in ("train", "library"):
        records, grads = pool4.run(_collectives_job, layout, mesh, how)[0]
        reductions = [
            r
            for r in records
            if r[0] in ("all_reduce", "reduce_scatter") and r[2] != "forward" and any(a in DATA_AXES for a in r[1])
        ]
        assert reductions, f"{layout} {how}: no gradient reduction over a data axis was counted: {records}"
        # a gradient is floating; the used-parameter flags (NOTE [unused parameters]) are bytes
        bad = [r for r in reductions if r[3] != "torch.float32" and r[3] != "torch.uint8"]
        assert not bad, f"{layout} {how}: gradient reductions not in float32: {bad}"
        gathers = [
            r for r in records if r[0] == "all_gather" and r[2] != "optimizer" and any(a in DATA_AXES for a in r[1])
        ]
        assert all(r[3] == "torch.bfloat16" for r in gathers), f"{layout} {how}: gathers {gathers}"
        if how == "train":
            assert grads == ["torch.float32"], f"{layout}: optimizer gradients in {grads}"


# --------------------------------------------------------------------------- (b) accumulation
class Probe(nn.Module):
    """One linear layer and a cross-entropy loss; zero weights, so the logits are 0 and the
    loss gradient is (softmax - onehot)/n = {1/4, -3/4}/n exactly: a gradient computed in
    bf16 whose every rounding is known (``tolerances.accumulated_grad_atol``)."""

    param_axes: ClassVar[dict] = {"w": ("vocab", "embed")}

    def __init__(self, vocab: int = 4, embed: int = 8, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(vocab, embed, device=device))

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.zeros_(self.w)

    def forward(self, x, labels):
        w = self.w
        logits = F.linear(x.to(w.dtype), w)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _probe_data(ranks: int, accum: int, small: float):
    """Per micro-batch, one token per rank (x of shape (ranks, 1, 8), all labels 0): the
    first micro-batch's rank-0 token is x = 1, every other token x = ``small`` (a power of
    two): each term is exact in bf16 and fp16, their sum needs more than 8 bits."""
    xs, ys = [], []
    for m in range(accum):
        x = torch.full((ranks, 1, 8), small)
        if m == 0:
            x[0] = 1.0
        xs.append(x)
        ys.append(torch.zeros((ranks, 1), dtype=torch.long))
    return xs, ys


def _accumulate_job(
    layout: str, mesh_shape: str, accum: int, kw: dict, small: float = 2.0**-10, loss_scale: float = 1.0
):
    """The probe's gradient accumulated over ``accum`` micro-batches, sharded with ``kw``;
    the fp32 one-device gradient; and Σ_k |G_k| over the (rank, micro-batch) terms."""
    import meshlm

    mesh = meshlm.make_mesh(mesh_shape)
    ranks = mesh.size()
    xs, ys = _probe_data(ranks, accum, small)
    model = meshlm.shard(Probe(device="meta"), layout, mesh, **kw)
    for x, y in zip(xs, ys):
        loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh))
        (loss / accum * loss_scale).backward()
    p = model._parameters["w"]  # the stored parameter (model.w is its at-use copy)
    g = p.grad if getattr(p, "main_grad", None) is None else p.main_grad  # NOTE [main grads]
    dtype = str(g._local_tensor.dtype)
    got = g.full_tensor().double() / loss_scale
    # the fp32 one-device reference, the same micro-batches accumulated in float32; and the
    # terms' magnitudes, one token at a time (each token's share of its micro-batch mean)
    ref = Probe()
    ref.w.data.zero_()
    abs_sum = torch.zeros_like(ref.w, dtype=torch.float64)
    for x, y in zip(xs, ys):
        (ref(x, y) / accum).backward()
        for r in range(ranks):
            one = Probe()
            one.w.data.zero_()
            (one(x[r : r + 1], y[r : r + 1]) / (accum * ranks)).backward()
            abs_sum += one.w.grad.double().abs()
    return dtype, got, ref.w.grad.double(), abs_sum


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("zero1", "dp=2"), ("zero2", "dp=2")])
def test_bf16_accumulation_is_fp32(pool2, layout, mesh):
    """grad_accum=4 on 2 ranks (K = 8 terms): the gradient ``meshlm train`` accumulates is
    float32 and within ``accumulated_grad_atol`` of the fp32 one-device gradient; storing
    and accumulating it in bf16 (the old bf16 parameters) misses it by 1.75x that bound.

    Numbers, per gradient entry G = d·(1 + 7·2^-10)/8 (d = -3/4 or 1/4; the 1/8 is the mean
    over 2 tokens and 4 micro-batches; every term has the sign of d, so Σ_k|G_k| = |G|):
    the bound is (2^-8 + 7·2^-24)·|G| = 3.91e-3·|G|.  fp32 reduction and accumulation are
    exact here (error 0).  bf16 summation rounds every partial sum back to the large term
    (the small terms, 2^-10 of it, and two of them, stay below half an ulp), losing
    7·2^-10/(1 + 7·2^-10)·|G| = 6.79e-3·|G|: 1.74x the bound."""
    from harness.tolerances import accumulated_grad_atol

    accum, terms = 4, 8
    kw = _train_shard_kwargs("bfloat16", layout, mesh)  # zero1/zero2: bf16 storage, fp32 main grads
    dtype, got, ref, abs_sum = pool2.run(_accumulate_job, layout, mesh, accum, kw)[0]
    assert dtype == "torch.float32", f"{layout}: gradient accumulated in {dtype}"
    atol = accumulated_grad_atol(abs_sum, terms)
    err = (got - ref).abs()
    assert bool((err <= atol).all()), f"{layout}: error {err.max():.3e} exceeds the bound: {err / atol}"
    # A bf16-accumulating implementation (bf16 storage, so bf16 .grad; bf16 reductions):
    # the bound catches it.
    bf16 = {"param_dtype": torch.bfloat16, "compute_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
    dtype16, got16, ref16, _ = pool2.run(_accumulate_job, layout, mesh, accum, bf16)[0]
    assert dtype16 == "torch.bfloat16"
    ratio = float(((got16 - ref16).abs() / atol).max())
    print(f"{layout}: fp32 accumulation error / bound {float((err / atol).max()):.3f}; bf16 accumulation {ratio:.3f}")
    assert ratio > 1.7, f"{layout}: bf16 accumulation stays within the bound ({ratio:.2f}x): the test cannot fail"


# --------------------------------------------------------------------------- (c) fp16 loss scaling
def _overflow_job(inject_rank: int):
    """fsdp on 2 ranks in fp16 under a LossScaler: (1) an overflow on one rank only (an Inf
    written into that rank's gradient shard) skips the step on every rank and halves the
    scale; (2) a natural overflow (a scale so large the fp16 backward overflows) does the
    same; (3) a normal step then steps."""
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.layout.precision import LossScaler

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh("fsdp=2")
    model = meshlm.shard(Llama(cfg, device="meta"), "fsdp", mesh, **_train_shard_kwargs("float16"))
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    toks = torch.randint(0, cfg.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    x, y = meshlm.shard_batch(toks[:, :-1], "fsdp", mesh), meshlm.shard_batch(toks[:, 1:], "fsdp", mesh)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out = {}

    def step(scaler, inject=False):
        scaler.scale_loss(model(x, y)).backward()
        if inject and torch.distributed.get_rank() == inject_rank:
            dict(model.named_parameters())["layers.0.attn.wq"].grad._local_tensor.view(-1)[3] = float("inf")
        s0 = scaler.scale
        norm, stepped = scaler.step(opt, 1.0)
        opt.zero_grad()
        same = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
        return {
            "scale_before": s0,
            "scale_after": scaler.scale,
            "stepped": stepped,
            "finite_norm": math.isfinite(norm),
            "params_unchanged": same,
            "opt_state": len(opt.inner.state),
        }

    out["injected"] = step(LossScaler(init_scale=2.0**8), inject=True)
    out["natural"] = step(LossScaler(init_scale=2.0**40))
    scaler = LossScaler(init_scale=2.0**8, growth_interval=1)
    out["normal"] = step(scaler)
    out["state"] = scaler.state_dict()
    return out


def test_fp16_overflow_skips_on_every_rank(pool2):
    for rank, r in enumerate(pool2.run(_overflow_job, 1)):
        for case in ("injected", "natural"):
            c = r[case]
            assert not c["stepped"] and not c["finite_norm"], f"rank {rank} {case}: {c}"
            assert c["scale_after"] == c["scale_before"] / 2, f"rank {rank} {case}: {c}"
            assert c["params_unchanged"] and c["opt_state"] == 0, f"rank {rank} {case}: {c}"
        n = r["normal"]
        assert n["stepped"] and n["finite_norm"] and not n["params_unchanged"], f"rank {rank}: {n}"
        assert n["scale_after"] == 2 * n["scale_before"], f"rank {rank}: growth_interval=1 doubles it: {n}"
        assert r["state"] == {"scale": 2.0**9, "good_steps": 0}


def test_fp16_loss_scaling_keeps_small_gradients(pool2):
    """fp16 compute on the probe, with terms of 2^-25 (x = 2^-20): unscaled, the fp16 matmul
    underflows them to 0 (below fp16's smallest subnormal, 2^-24); scaled by 2^16 and
    divided back in fp32, the gradient equals the fp32 one-device gradient within the same
    derived bound (fp16 rounds more finely than bf16, so the bf16 bound holds a fortiori)."""
    from harness.tolerances import accumulated_grad_atol

    kw = _train_shard_kwargs("float16")
    _, got, ref, abs_sum = pool2.run(_accumulate_job, "ddp", "dp=2", 4, kw, 2.0**-20, 2.0**16)[0]
    atol = accumulated_grad_atol(abs_sum, 8)
    assert bool(((got - ref).abs() <= atol).all()), f"scaled: {(got - ref).abs().max():.3e}"
    _, got1, ref1, _ = pool2.run(_accumulate_job, "ddp", "dp=2", 4, kw, 2.0**-20, 1.0)[0]
    lost = (ref1 - got1).abs()
    assert bool((lost > 0).all()), "without loss scaling the small fp16 gradients should have underflowed"


# --------------------------------------------------------------------------- grad norm
def _norm_job():
    """clip_grad_norm_ on a 2-D mesh under CommCounter: the norm's collectives and value,
    and the one-device norm of the same step's gradients."""
    from meshlm.runtime.comm import CommCounter
    from meshlm.models import Llama, llama_config
    from harness.setup import tiny_sharded

    mesh, model, opt, x, y = tiny_sharded("fsdp_tp", {"fsdp": 2, "tp": 2}, batch=4, seq=8)
    model(x, y).backward()
    opt.reduce_grads()
    with CommCounter(mesh) as cc:
        norm = opt.clip_grad_norm_(1e9)
    cfg = llama_config("llama_tiny")
    toks = torch.randint(0, cfg.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    ref = Llama(cfg, seed=0)
    ref(toks[:, :-1], toks[:, 1:]).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
    return ([(c.kind, c.axes, c.device) for c in cc.records], mesh.device_type, float(norm), float(ref_norm))


def test_grad_norm_reduces_over_the_mesh_groups(pool4):
    """The global norm is all-reduced over the mesh's own process groups (one per mesh dim),
    on the mesh's device: not on the default group with a CPU tensor, which a CUDA job's
    NCCL group would refuse.  Its value is the one-device norm."""
    for res in pool4.run(_norm_job):
        _check_norm(*res)


def _check_norm(records, device, norm, ref_norm) -> None:
    """``_norm_job``'s result as it must be (also mutation/battery.py's check)."""
    from harness.tolerances import NORM_RTOL

    assert sorted(records) == [("all_reduce", ("fsdp",), device), ("all_reduce", ("tp",), device)], records
    assert abs(norm - ref_norm) <= NORM_RTOL * ref_norm, (norm, ref_norm)


# --------------------------------------------------------------------------- (d) ZeRO-1/2 at the floor
def _zero_bf16_job(layouts, steps: int = 3, accum: int = 2):
    """llama_tiny, ``steps`` AdamW steps of ``accum`` micro-batches, as ``meshlm train``
    shards each of ``layouts`` in bf16 on dp=2: per step the loss, the float32 gradients
    the optimizer steps with (gathered), and the parameters at the end (as float32)."""
    import meshlm
    from meshlm.models import llama_config
    from harness.setup import tiny_sharded

    cfg = llama_config("llama_tiny")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (4, 9), generator=gen) for _ in range(steps * accum)]
    out = {}
    for layout in layouts:
        kw = _train_shard_kwargs("bfloat16", layout, {"dp": 2})
        mesh, model, opt, _x, _y = tiny_sharded(layout, {"dp": 2}, batch=4, seq=8, **kw)
        losses, grads = [], []
        for s in range(steps):
            total = 0.0
            for k in range(accum):
                toks = batches[s * accum + k]
                x = meshlm.shard_batch(toks[:, :-1], layout, mesh)
                y = meshlm.shard_batch(toks[:, 1:], layout, mesh)
                loss = model(x, y)
                (loss / accum).backward()
                total += float(loss.detach()) / accum
            opt.reduce_grads()
            grads.append({f: m.grad.full_tensor().float() for f, m in opt.masters().items()})
            assert all(m.grad.dtype == torch.float32 for m in opt.masters().values())
            opt.step()
            opt.zero_grad()
            losses.append(total)
        params = {n: p.full_tensor().float() for n, p in model.named_parameters()}
        out[layout] = {
            "losses": losses,
            "grads": grads,
            "params": params,
            "dtype": str(next(iter(model.parameters())).dtype),
        }
    return out


def test_zero_bf16_storage_matches_fp32_storage(pool2):
    """ZeRO-1/2 in bf16 store bf16 parameters with a sharded fp32 master (started from the
    fp32 initial weights) and fp32 main gradients; ddp stores fp32 (the master) and casts
    at use.  Both compute with the same bf16 weights (the stored bf16 parameter is the fp32
    master rounded once, as the at-use cast rounds it), make the same local bf16
    gradients, and reduce and accumulate them in float32; what differs is the order of the
    float32 sums (ddp and zero2 reduce each micro-batch and then accumulate, zero1
    accumulates locally and reduces at the step).  So over 3 steps of 2 micro-batches the
    losses and the optimizer's gradients agree within the fp32 summation-order tolerances
    (``LOSS_RTOL``, ``GRAD_RTOL``/``GRAD_ATOL_OF_MAX``, tests/harness/tolerances.py), and
    the stored parameters equal the fp32 reference's rounded to bf16, within one bf16 ulp
    (2·``BF16_UNIT_ROUNDOFF`` relative) where an fp32-order difference in the master moves
    it across a rounding boundary.  Measured (2 ranks): losses and zero2's gradients
    bitwise equal, zero1's gradients within 7.2e-9 of the largest entry at step 3,
    parameters bitwise equal.  A master started from the bf16-rounded weights instead
    fails the loss check from step 2 on (3e-5 relative)."""
    from harness.tolerances import BF16_UNIT_ROUNDOFF, GRAD_ATOL_OF_MAX, GRAD_RTOL, LOSS_RTOL

    r = pool2.run(_zero_bf16_job, ["ddp", "zero1", "zero2"])[0]
    ref = r["ddp"]
    assert ref["dtype"] == "torch.float32"
    for layout in ("zero1", "zero2"):
        got = r[layout]
        assert got["dtype"] == "torch.bfloat16", f"{layout}: stored in {got['dtype']}"
        for s, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"{layout} step {s}: loss {a} vs {b}"
        for s, (g, h) in enumerate(zip(got["grads"], ref["grads"])):
            for f, want in h.items():
                tol = GRAD_RTOL * want.abs() + GRAD_ATOL_OF_MAX * want.abs().max()
                assert bool(((g[f] - want).abs() <= tol).all()), f"{layout} step {s} {f}: {(g[f] - want).abs().max()}"
        for n, want in ref["params"].items():
            err = (got["params"][n] - want.bfloat16().float()).abs()
            assert bool((err <= 2 * BF16_UNIT_ROUNDOFF * want.abs()).all()), f"{layout} {n}: {err.max()}"


def _clip_job():
    """clip_grad_norm_ given this step's norm: no collective, the gradients scaled to max_norm."""
    from meshlm.runtime.comm import CommCounter
    from harness.setup import tiny_sharded

    mesh, model, opt, x, y = tiny_sharded("fsdp_tp", {"fsdp": 2, "tp": 2}, batch=4, seq=8)
    model(x, y).backward()
    norm = opt.grad_norm()
    with CommCounter(mesh) as cc:
        total = opt.clip_grad_norm_(float(norm) / 2, norm=norm.double())  # any dtype: the norm comes back float32
    clipped = float(opt.grad_norm())
    # the coefficient is max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_'s: 1/3 here
    opt.clip_grad_norm_(1e-6, norm=torch.tensor(2e-6))
    return len(cc.records), total.dtype, float(norm), float(total), clipped, float(opt.grad_norm())


def test_clip_with_a_given_norm_scales_without_collectives(pool4):
    """``clip_grad_norm_(max_norm, norm=grad_norm())`` reuses the norm (no all-reduce),
    returns it as float32, and leaves gradients whose global norm is ``max_norm``; a given
    norm near the epsilon scales by ``max_norm / (norm + 1e-6)``."""
    for res in pool4.run(_clip_job):
        _check_clip(*res)


def _check_clip(n_collectives, dtype, norm, total, clipped, clipped_again) -> None:
    """``_clip_job``'s result as it must be (also mutation/battery.py's check)."""
    from harness.tolerances import NORM_RTOL

    assert n_collectives == 0
    assert dtype == torch.float32 and total == norm
    assert abs(clipped - norm / 2) <= NORM_RTOL * norm, (clipped, norm)
    assert abs(clipped_again - clipped / 3) <= NORM_RTOL * clipped, (clipped_again, clipped)
