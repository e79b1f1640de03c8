"""Stock DTensor code in a process where meshlm sharded and trained a model behaves as in a
process without meshlm, and meshlm's own DTensor rules still hold after it ran (NOTE [scoped
patches] in meshlm/_torch_compat/dtensor_scope.py).

The stock code is torch's tensor parallelism as its users write it (``parallelize_module``,
``loss_parallel()``, ``implicit_replication()``) and the ops meshlm has DTensor rules for,
on a mesh of its own.  It runs once in workers that trained meshlm's Llama under a
vocab-sharded layout first, and once in fresh workers that never imported meshlm: the same
values, and the same errors where torch refuses.

This module imports no meshlm at its top: the fresh workers import it to find their job.
"""

from __future__ import annotations

import sys

import pytest
import torch

from harness import dist_pool_fixture, run_distributed

pool2 = dist_pool_fixture(2, timeout_s=60)

V, D, B, S = 16, 8, 2, 6  # vocab, width, batch, seq: V divisible by 2
LAYOUT, MESH = "tp", "tp=2"  # vocab over tp: meshlm's loss and embedding rules run
# 2 ranks, not 4: DTensor's first CPU flash attention propagates its sharding through the
# op's decomposition, ~10 s of CPU on every rank, in both groups of workers


def _outcome(fn):
    """``("value", x)`` with a DTensor made whole, or ``("raised", exception type, whether it
    is DTensor's refusal of a plain tensor next to a DTensor)``."""
    from torch.distributed.tensor import DTensor

    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return ("raised", type(e).__name__, "got mixed torch.Tensor and DTensor" in str(e))
    return ("value", out.full_tensor() if isinstance(out, DTensor) else out)


def _stock_dtensor() -> dict:
    """Stock DTensor code (no meshlm): what each piece returns or raises, by name."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (n,))  # no dim names: equal to no mesh meshlm builds
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    out = {}

    # torch's vocab-parallel loss: a column-parallel head, forward and backward in loss_parallel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, V))
    parallelize_module(model, mesh, {"1": ColwiseParallel(use_local_output=False)})
    logits = model(tokens)
    out["logits placements"] = str(logits.placements)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    out["loss_parallel loss"] = loss.full_tensor()
    out["loss_parallel grads"] = {
        k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for k, p in model.named_parameters()
    }
    # the same loss once the block is left: DTensor refuses the plain labels
    out["cross entropy after loss_parallel"] = _outcome(
        lambda: F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    )

    # a plain tensor next to a DTensor: refused, but inside implicit_replication()
    x = distribute_tensor(torch.arange(12.0).view(4, 3), mesh, [Replicate()])
    out["mixed op"] = _outcome(lambda: x + torch.ones(4, 3))
    with implicit_replication():
        out["mixed op in implicit_replication"] = _outcome(lambda: x * torch.ones(4, 3))
        out["flag in implicit_replication"] = DTensor._op_dispatcher._allow_implicit_replication
    out["mixed op after implicit_replication"] = _outcome(lambda: x * torch.ones(4, 3))
    out["flag"] = DTensor._op_dispatcher._allow_implicit_replication

    # a Python number of a Partial DTensor: DTensor reads this rank's part
    out["item of a Partial"] = DTensor.from_local(torch.tensor(float(rank + 1)), mesh, [Partial()]).item()

    # a vocab-sharded embedding: DTensor's own rule, a masked partial sum
    table = distribute_tensor(torch.randn(V, D, generator=gen), mesh, [Shard(0)]).requires_grad_()
    emb = F.embedding(distribute_tensor(tokens, mesh, [Replicate()]), table)
    out["embedding placements"] = str(emb.placements)
    whole = emb.full_tensor()  # once: DTensor's masked partial sum is reduced a single time
    out["embedding"] = whole
    whole.sum().backward()
    out["embedding grad"] = table.grad.full_tensor()

    # the gradient of a mean loss of a batch-sharded input, as DTensor computes it
    pred = distribute_tensor(torch.randn(2 * n, 3, generator=gen), mesh, [Shard(0)]).requires_grad_()
    F.mse_loss(pred, distribute_tensor(torch.zeros(2 * n, 3), mesh, [Shard(0)])).backward()
    out["mse_loss grad"] = pred.grad.full_tensor()

    # a view of a transpose whose local tensor a gather left laid out otherwise: DTensor's error
    o = distribute_tensor(torch.randn(2, 3, 4 * n, generator=gen), mesh, [Replicate()])
    o = o.unflatten(-1, (2 * n, -1)).transpose(1, 2).redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    out["view of a gathered transpose"] = _outcome(lambda: (o * 2.0).transpose(1, 2).flatten(2, 3))

    # CPU flash attention: DTensor has no rule for it (torch 2.13 decomposes the forward)
    q = distribute_tensor(torch.randn(1, n, 4, 8, generator=gen), mesh, [Shard(1)]).requires_grad_()
    out["cpu flash attention"] = _outcome(lambda: F.scaled_dot_product_attention(q, q, q))
    out["cpu flash attention backward"] = _outcome(lambda: F.scaled_dot_product_attention(q, q, q).sum().backward())
    return out


def _meshlm_rules() -> None:
    """meshlm's DTensor rules on a mesh of its own, each against plain torch on one process."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import meshlm
    from harness import tolerances as tol

    mesh = meshlm.make_mesh(MESH)
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    full = torch.randn(B, S, V, generator=gen)
    # vocab-sharded logits and plain labels, outside any context: meshlm's loss rule
    logits = distribute_tensor(full, mesh, [Shard(2)])
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(
        loss.full_tensor(), F.cross_entropy(full.flatten(0, 1), labels.flatten()), rtol=tol.LOSS_RTOL, atol=0
    )
    # the global value of a Partial
    assert DTensor.from_local(torch.tensor(float(rank + 1)), mesh, [Partial()]).item() == n * (n + 1) / 2
    # a vocab-parallel embedding: a partial sum (the next constrain reduces it), not a masked one
    table = torch.randn(V, D, generator=gen)
    ids = distribute_tensor(tokens, mesh, [Replicate()])
    emb = F.embedding(ids, distribute_tensor(table, mesh, [Shard(0)]))
    assert tuple(emb.placements) == (Partial(),), emb.placements
    torch.testing.assert_close(emb.full_tensor(), F.embedding(tokens, table), rtol=0, atol=0)
    # a plain tensor next to one of meshlm's DTensors, in a thread that ran a sharded forward
    x = distribute_tensor(torch.arange(12.0).view(4, 3), mesh, [Replicate()])
    torch.testing.assert_close((x + torch.ones(4, 3)).full_tensor(), torch.arange(12.0).view(4, 3) + 1)


def _train() -> dict:
    from harness.parity import check_training

    return check_training(LAYOUT, MESH, optims=("sgd",), steps=2)


def _stock_between_meshlm_rules() -> dict:
    return {"rules before": _failure(_meshlm_rules), "stock": _stock_dtensor(), "rules after": _failure(_meshlm_rules)}


def _failure(check) -> str | None:
    """None where ``check()`` passes, else what it raised (so that the job goes on)."""
    import traceback

    try:
        check()
    except Exception:  # noqa: BLE001 - reported to the test
        return traceback.format_exc()
    return None


def _stock_without_meshlm() -> dict:
    assert not [m for m in sys.modules if m.startswith("meshlm")], "this worker imported meshlm"
    return _stock_dtensor()


def _same(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _same(got[k], want[k], f"{where}: {k}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: values differ"
    else:
        assert got == want, f"{where}: {got!r} with meshlm, {want!r} without"


@pytest.fixture(scope="module")
def without_meshlm():
    """The stock code's results in fresh workers that never imported meshlm."""
    return run_distributed(_stock_without_meshlm, 2, timeout_s=60)


@pytest.fixture(scope="module")
def with_meshlm(pool2):
    """In the same workers, one job after the other: meshlm trained; its rules checked, the
    stock code, its rules again; meshlm trained again."""
    before = pool2.run(_train)
    between = pool2.run(_stock_between_meshlm_rules)
    after = pool2.run(_train)
    return [{"before": b, **m, "after": a} for b, m, a in zip(before, between, after)]


def test_stock_dtensor_code_is_untouched_by_meshlm(with_meshlm, without_meshlm):
    """After meshlm trained a model in these workers, torch's loss_parallel() with a
    parallelize_module head, a mixed plain tensor and DTensor op (refused), implicit
    replication inside and after its context, a Python number of a Partial, a vocab-sharded
    embedding, a mean loss's gradient, a view DTensor refuses and CPU flash attention
    return or raise what they do in workers without meshlm.  Before: meshlm's rules and its
    implicit replication applied to every DTensor of the process."""
    for rank, (got, want) in enumerate(zip(with_meshlm, without_meshlm)):
        _same(got["stock"], want, f"rank {rank}")
    # what is compared includes refusals, not only successes
    assert without_meshlm[0]["mixed op"] == ("raised", "RuntimeError", True)
    assert without_meshlm[0]["cross entropy after loss_parallel"] == ("raised", "RuntimeError", True)


def test_meshlm_rules_hold_after_stock_code(with_meshlm):
    """meshlm's training (a vocab-sharded Llama: its loss and embedding rules) matches one
    device before and after stock DTensor code that opens and leaves torch's loss_parallel()
    and implicit_replication() in the same workers; meshlm's rules still act on its mesh
    outside any sharded forward (checked in the job against plain torch)."""
    from harness.parity import assert_parity

    for r in with_meshlm:
        assert r["rules before"] is None, r["rules before"]
        assert r["rules after"] is None, r["rules after"]
    assert_parity([r["before"] for r in with_meshlm])
    assert_parity([r["after"] for r in with_meshlm])
    assert all(r["after"]["root"]["dtensor"] > 0 for r in with_meshlm), "no sharded forward ran under DTensor"
