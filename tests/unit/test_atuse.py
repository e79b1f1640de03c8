"""``lowering.atuse.AtUse``, the per-parameter gather at use and its gradient reduction, on
a fake 2 x 2 mesh (dp, fsdp): what it computes in and which collectives it issues, in which
dtype and over which axis, and the gradient's placements and dtype.  The fake group's
collectives move no data, so values are not checked here (the multi-process parity tests
check them); what is checked is what AtUse decides: the target placements, the
reduce-scatter before the all-reduce (HSDP all-reduces 1/fsdp of the gradient over dp),
the casts, ZeRO-1's gradients kept Partial, and main gradients.  Bytes are derived from the
parameter's (8, 6) shape: 48 elements, 192 bytes in float32.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import meshlm
from meshlm.core.state import RUN
from meshlm.runtime.comm import CommCounter
from meshlm.runtime.lowering.atuse import _AT_USE, AtUse, at_use_key

R, P, S0 = Replicate(), Partial(), Shard(0)
f32, bf16 = torch.float32, torch.bfloat16
SHAPE = (8, 6)
FULL = 8 * 6  # elements


@pytest.fixture
def mesh():
    m = meshlm.make_mesh({"dp": 2, "fsdp": 2}, fake=True)
    yield m
    if dist.is_initialized():
        dist.destroy_process_group()


def _param(mesh, storage, dtype=f32):
    local = list(SHAPE)
    for i, pl in enumerate(storage):
        if isinstance(pl, Shard):
            local[pl.dim] //= mesh.size(i)
    t = DTensor.from_local(
        torch.randn(local).to(dtype), mesh, storage, run_check=False, shape=torch.Size(SHAPE), stride=(6, 1)
    )
    return torch.nn.Parameter(t)


def _run(mesh, p, compute, grads, grad_pl, *, dtype=None, reduce_dtype=None, grad_dtype=None, regather=False):
    """Forward through AtUse and backward with a gradient placed ``grad_pl``; the
    collectives of each as (kind, axes, bytes, dtype), in order."""
    with CommCounter(mesh) as cc:
        out = AtUse.apply(p, compute, grads, dtype, reduce_dtype, regather, grad_dtype)
    fwd = [(r.kind, r.axes, r.bytes, r.dtype) for r in cc.records]
    g_local = list(SHAPE)
    for i, pl in enumerate(grad_pl):
        if isinstance(pl, Shard):
            g_local[pl.dim] //= mesh.size(i)
    g = DTensor.from_local(torch.ones(g_local, dtype=out.dtype), mesh, grad_pl, run_check=False)
    with CommCounter(mesh) as cc:
        out.backward(g)
    bwd = [(r.kind, r.axes, r.bytes, r.dtype) for r in cc.records]
    return out, fwd, bwd


def test_hsdp_gathers_over_fsdp_and_reduce_scatters_before_the_all_reduce(mesh):
    p = _param(mesh, (R, S0))
    out, fwd, bwd = _run(mesh, p, (R, R), (R, S0), (P, P), regather=True)
    assert tuple(out.placements) == (R, R) and out.dtype == f32 and tuple(out.shape) == SHAPE
    assert fwd == [("all_gather", ("fsdp",), FULL * 4, f32)]
    # The reduce-scatter over fsdp first, then the all-reduce over dp of the half it left.
    assert bwd == [("reduce_scatter", ("fsdp",), FULL * 4, f32), ("all_reduce", ("dp",), FULL * 4 // 2, f32)]
    assert tuple(p.grad.placements) == (R, S0) and p.grad.dtype == f32
    assert RUN.gathering == 0


def test_compute_in_bf16_reduce_in_float32(mesh):
    """The cast comes before the gather (half the bytes); the gradient is reduced in the
    reduce dtype and handed to the float32 parameter in float32."""
    p = _param(mesh, (R, S0))
    out, fwd, bwd = _run(mesh, p, (R, R), (R, S0), (P, P), dtype=bf16, reduce_dtype=f32)
    assert out.dtype == bf16 and tuple(out.placements) == (R, R)
    assert fwd == [("all_gather", ("fsdp",), FULL * 2, bf16)]
    assert bwd == [("reduce_scatter", ("fsdp",), FULL * 4, f32), ("all_reduce", ("dp",), FULL * 2, f32)]
    assert p.grad.dtype == f32 and tuple(p.grad.placements) == (R, S0)


def test_without_a_reduce_dtype_the_gradient_is_reduced_as_it_comes(mesh):
    p = _param(mesh, (R, S0))
    _out, _fwd, bwd = _run(mesh, p, (R, R), (R, S0), (P, P), dtype=bf16)
    assert bwd == [("reduce_scatter", ("fsdp",), FULL * 2, bf16), ("all_reduce", ("dp",), FULL, bf16)]
    assert p.grad.dtype == f32  # cast back to the parameter's dtype after the reduction


def test_replicated_parameter_all_reduces_over_every_axis(mesh):
    p = _param(mesh, (R, R))
    out, fwd, bwd = _run(mesh, p, (R, R), (R, R), (P, P))
    assert fwd == [] and out is not p  # nothing to move: a view, so autograd sees AtUse
    assert Counter(bwd) == Counter(
        {("all_reduce", ("dp",), FULL * 4, f32): 1, ("all_reduce", ("fsdp",), FULL * 4, f32): 1}
    )
    assert tuple(p.grad.placements) == (R, R)


def test_sharded_compute_reduces_only_the_partial_axis(mesh):
    """Compute as stored (a tensor-parallel-like shard): no gather; a gradient Partial over dp
    and sharded like the storage over fsdp is all-reduced over dp only."""
    p = _param(mesh, (R, S0))
    out, fwd, bwd = _run(mesh, p, (R, S0), (R, S0), (P, S0))
    assert fwd == [] and tuple(out.placements) == (R, S0) and out is not p
    assert bwd == [("all_reduce", ("dp",), FULL * 4 // 2, f32)]


@pytest.mark.parametrize(
    "storage,grad_pl,want",
    [
        ((R, R), (P, P), (P, P)),  # ZeRO-1: Partial stays Partial until the optimizer step
        ((R, S0), (P, R), (P, S0)),  # a non-Partial dim follows the storage (a local chunk)
    ],
)
def test_local_gradients_stay_unreduced(mesh, storage, grad_pl, want):
    p = _param(mesh, storage)
    _out, _fwd, bwd = _run(mesh, p, (R, R), None, grad_pl)
    assert [k for k, *_ in bwd if k != "all_gather"] == []  # no reduction at all
    assert tuple(p.grad.placements) == want and p.grad.dtype == f32


def test_main_gradient_of_a_bf16_parameter(mesh):
    """NOTE [main grads]: a bf16 parameter's gradient is reduced in float32 into its float32
    ``main_grad`` (the grads placements); autograd gets no gradient, so ``.grad`` stays None."""
    p = _param(mesh, (R, S0), dtype=bf16)
    _out, _fwd, bwd = _run(mesh, p, (R, R), (R, S0), (P, P), reduce_dtype=f32, grad_dtype=f32)
    assert bwd == [("reduce_scatter", ("fsdp",), FULL * 4, f32), ("all_reduce", ("dp",), FULL * 2, f32)]
    assert p.grad is None
    mg = p.main_grad
    assert isinstance(mg, DTensor) and mg.dtype == f32 and tuple(mg.placements) == (R, S0)
    assert tuple(mg.to_local().shape) == (4, 6)


def test_a_grad_dtype_equal_to_the_parameters_is_a_plain_gradient(mesh):
    p = _param(mesh, (R, S0))
    _run(mesh, p, (R, R), (R, S0), (P, P), reduce_dtype=f32, grad_dtype=f32)
    assert p.grad is not None and getattr(p, "main_grad", None) is None


def test_at_use_keys_are_interned_by_content():
    args = ((R, R), (R, S0), bf16, f32, True, None)
    k = at_use_key(*args)
    assert at_use_key(*args) == k and at_use_key(*(list(a) if isinstance(a, tuple) else a for a in args)) == k
    assert _AT_USE[k] == args
    others = [((R, S0), (R, S0), bf16, f32, True, None), ((R, R), None, bf16, f32, True, None),
              ((R, R), (R, S0), None, f32, True, None), ((R, R), (R, S0), bf16, None, True, None),
              ((R, R), (R, S0), bf16, f32, False, None), ((R, R), (R, S0), bf16, f32, True, f32)]  # fmt: skip
    keys = {at_use_key(*o) for o in others}
    assert len(keys) == len(others) and k not in keys
