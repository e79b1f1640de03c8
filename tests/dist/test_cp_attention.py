"""Context-parallel attention (meshlm/runtime/cp/, NOTE [cp attention] in
meshlm/runtime/cp/ring.py) on 2 and 4 gloo ranks against plain SDPA over the whole sequence
on one process: the output and dq, dk, dv of every rank's chunks, for causal and not, with
and without load balancing, ring and all-gather, grouped-query (4 query heads on 2 key/value
heads) and multi-head (and a group of one); one bf16 case, one sequence of 2,048, one cp group that is not the
world (global ranks differ from group ranks).  And the bytes: CommCounter counts exactly the
analytic formula of NOTE [cp attention] for both variants.

Tolerances: NOTE [cp attention tolerance] in tests/harness/tolerances.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import dist_pool_fixture
from harness.tolerances import activation_tol, bf16_grad_tol, grad_tol

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

B, D = 2, 16


def _positions(rank: int, n: int, seq: int, balanced: bool) -> list[int]:
    """The layout as NOTE [cp attention] states it: contiguous, or chunks r and 2n-1-r."""
    s = seq // n
    if not balanced:
        return list(range(rank * s, (rank + 1) * s))
    c = s // 2
    return [*range(rank * c, (rank + 1) * c), *range((2 * n - 1 - rank) * c, (2 * n - rank) * c)]


def _inputs(seq: int, hq: int, hkv: int, dtype: torch.dtype, seed: int = 0):
    """Global q, k, v and the output gradient, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, hq, seq, D), (B, hkv, seq, D), (B, hkv, seq, D), (B, hq, seq, D)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _run_cp(seq, hq, hkv, causal, balanced, variant, dtype=torch.float32, groups=None):
    """On every rank: its chunks of the global inputs through cp_attention, forward and
    backward.  ``groups``: cp groups as lists of global ranks (default: the world)."""
    from meshlm.runtime.cp import cp_attention

    group = dist.group.WORLD
    if groups is not None:
        made = [dist.new_group(ranks) for ranks in groups]
        group = next(g for g, ranks in zip(made, groups) if dist.get_rank() in ranks)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = _inputs(seq, hq, hkv, dtype)
    pos = _positions(r, n, seq, balanced)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = cp_attention(ql, kl, vl, group=group, causal=causal, balanced=balanced, variant=variant)
    out.backward(dout[:, :, pos])
    return {"pos": pos, "out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _reference(seq, hq, hkv, causal, dtype=torch.float32, compute_dtype=None):
    """Plain SDPA over the whole sequence on this process: out, dq, dk, dv."""
    q, k, v, dout = _inputs(seq, hq, hkv, dtype)
    q, k, v, dout = (t.to(compute_dtype or dtype) for t in (q, k, v, dout))
    for t in (q, k, v):
        t.requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _assemble(results, name):
    """The global tensor from every rank's chunks, each put back at its global positions."""
    first = results[0][name]
    seq = sum(len(r["pos"]) for r in results)
    full = torch.full((*first.shape[:2], seq, first.shape[3]), float("nan"), dtype=first.dtype)
    for r in results:
        full[:, :, r["pos"]] = r[name]
    return full


def _worst(got, ref, tol) -> float:
    return float(((got.float() - ref.float()).abs() / tol).max())


def _check(results, ref, tols) -> dict[str, float]:
    ratios = {name: _worst(_assemble(results, name), ref[name], tols[name]) for name in ("out", "dq", "dk", "dv")}
    assert all(x <= 1.0 for x in ratios.values()), f"worst |cp - sdpa| / tolerance: {ratios}"
    return ratios


def _fp32_tols(ref):
    return {"out": activation_tol(ref["out"]), **{g: grad_tol(ref[g]) for g in ("dq", "dk", "dv")}}


CASES = [
    pytest.param(causal, balanced, variant, hkv, id=f"{variant}-{'causal' if causal else 'full'}-"
                 f"{'balanced' if balanced else 'contiguous'}-{'gqa' if hkv == 2 else 'mha'}")
    for variant in ("ring", "allgather")
    for causal in (True, False)
    for balanced in (True, False)
    for hkv in (2, 4)
]  # fmt: skip


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_cp_attention_1(pool1, variant):
    """A cp group of one: plain attention, no message."""
    results = pool1.run(_run_cp, 32, 4, 2, True, True, variant)
    ref = _reference(32, 4, 2, True)
    _check(results, ref, _fp32_tols(ref))


@pytest.mark.parametrize("causal, balanced, variant, hkv", CASES)
def test_cp_attention_2(pool2, causal, balanced, variant, hkv):
    seq = 64
    results = pool2.run(_run_cp, seq, 4, hkv, causal, balanced, variant)
    _check(results, _reference(seq, 4, hkv, causal), _fp32_tols(_reference(seq, 4, hkv, causal)))


@pytest.mark.parametrize("causal, balanced, variant, hkv", CASES)
def test_cp_attention_4(pool4, causal, balanced, variant, hkv):
    seq = 96  # 24 tokens a rank, chunks of 12: block sizes the flash kernel does not tile evenly
    results = pool4.run(_run_cp, seq, 4, hkv, causal, balanced, variant)
    ref = _reference(seq, 4, hkv, causal)
    _check(results, ref, _fp32_tols(ref))


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_cp_attention_long_sequence(pool4, variant):
    seq = 2048
    results = pool4.run(_run_cp, seq, 4, 2, True, True, variant)
    ref = _reference(seq, 4, 2, True)
    _check(results, ref, _fp32_tols(ref))


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_cp_attention_on_a_subgroup(pool4, variant):
    """Two cp groups of 2 ({0, 2} and {1, 3}) in a world of 4: neighbours in the ring are
    group ranks, not global ones.  Both groups get the right answer."""
    seq = 64
    results = pool4.run(_run_cp, seq, 4, 2, True, True, variant, groups=[[0, 2], [1, 3]])
    ref = _reference(seq, 4, 2, True)
    for group in ([0, 2], [1, 3]):
        _check([results[i] for i in group], ref, _fp32_tols(ref))


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_cp_attention_bf16(pool4, variant):
    """bf16 inputs: the cp result against plain bf16 SDPA, within the split-sum bound whose
    scale is bf16 SDPA's own distance from float32 SDPA on the same inputs."""
    seq, n = 128, 4
    results = pool4.run(_run_cp, seq, 4, 2, True, True, variant, torch.bfloat16)
    assert all(r[name].dtype == torch.bfloat16 for r in results for name in ("out", "dq", "dk", "dv"))
    ref16 = _reference(seq, 4, 2, True, torch.bfloat16)
    ref32 = _reference(seq, 4, 2, True, torch.bfloat16, compute_dtype=torch.float32)
    _check(results, ref16, {name: bf16_grad_tol(ref16[name].float(), ref32[name], n) for name in ref16})


def _bad_call(what: str) -> str:
    from meshlm.core.errors import ConfigError
    from meshlm.runtime.cp import cp_attention

    q, k, v = torch.randn(1, 4, 6, D), torch.randn(1, 2, 6, D), torch.randn(1, 2, 6, D)
    kwargs = {"group": dist.group.WORLD, "balanced": False, "variant": "ring"}
    if what == "variant":
        kwargs["variant"] = "ulysses"
    elif what == "odd":
        kwargs["balanced"], q, k, v = True, q[:, :, :5], k[:, :, :5], v[:, :, :5]
    elif what == "heads":
        k, v = torch.randn(1, 3, 6, D), torch.randn(1, 3, 6, D)
    try:
        cp_attention(q, k, v, **kwargs)
    except (ConfigError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "what, says",
    [
        ("variant", ["ConfigError", "'ulysses'", "ring, allgather"]),
        ("odd", ["ValueError", "5 tokens", "multiple of 2 x cp (4)"]),
        ("heads", ["ValueError", "k (1, 3, 6, 16)", "kv_heads dividing heads"]),
    ],
)
def test_cp_attention_refuses_bad_input(pool2, what, says):
    """A clear error on every rank, before any rank enters a collective (no hang)."""
    for msg in pool2.run(_bad_call, what):
        assert all(part in msg for part in says), msg


# --------------------------------------------------------------------------- bytes


def _count_cp(seq, hq, hkv, variant, dtype):
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.cp import cp_attention

    n, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = _inputs(seq, hq, hkv, dtype)
    pos = _positions(r, n, seq, True)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    with CommCounter() as cc:
        out = cp_attention(ql, kl, vl, group=dist.group.WORLD, causal=True, balanced=True, variant=variant)
        out.backward(dout[:, :, pos])
    return {
        f"{kind} {phase}": (int(e["count"]), int(e["bytes"]), e["wire_bytes"])
        for (kind, _, phase), e in cc.summary(by_phase=True).items()
    }


def _formula(variant: str, n: int, local_kv_elems: int, elem_size: int) -> dict[str, tuple[int, int, float]]:
    """NOTE [cp attention]'s bytes per rank: K = one local k (= v), F = its float32 gradient
    accumulator; (count, logical bytes, wire bytes) per collective kind and phase."""
    K, F_ = local_kv_elems * elem_size, local_kv_elems * 4
    if variant == "ring":
        return {
            "send forward": (2 * (n - 1), 2 * (n - 1) * K, 2 * (n - 1) * K),
            "recv forward": (2 * (n - 1), 2 * (n - 1) * K, 0.0),
            "send backward": (2 * (n - 1) + 2 * n, 2 * (n - 1) * K + 2 * n * F_, 2 * (n - 1) * K + 2 * n * F_),
            "recv backward": (2 * (n - 1) + 2 * n, 2 * (n - 1) * K + 2 * n * F_, 0.0),
        }
    return {
        "all_gather forward": (2, 2 * n * K, 2 * (n - 1) * K),
        "all_gather backward": (2, 2 * n * K, 2 * (n - 1) * K),
        "reduce_scatter backward": (2, 2 * n * F_, 2 * (n - 1) * F_),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("n", [2, 4])
def test_cp_attention_bytes(pool2, pool4, n, variant, dtype):
    """Every collective of a forward and backward, per rank, is the formula's, exactly; and
    in forward both variants put (n-1)/n of the global K and V on the wire."""
    seq, hq, hkv = 64, 4, 2
    pool = pool2 if n == 2 else pool4
    got = pool.run(_count_cp, seq, hq, hkv, variant, dtype)
    want = _formula(variant, n, B * hkv * (seq // n) * D, torch.empty((), dtype=dtype).element_size())
    for rank, counted in enumerate(got):
        assert counted == want, f"rank {rank}: counted {counted}, formula {want}"
    global_kv = 2 * B * hkv * seq * D * torch.empty((), dtype=dtype).element_size()
    fwd_wire = sum(w for key, (_, _, w) in want.items() if key.endswith("forward"))
    assert fwd_wire == (n - 1) / n * global_kv
