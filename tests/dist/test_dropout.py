"""Dropout under layouts (NOTE [dropout keys] in meshlm/core/rng.py): a Llama with residual
dropout in training mode has the one-device loss and gradients under every layout; the
ranks of a data-parallel group draw different masks (for their different rows) and the
ranks of a tensor-parallel group the same mask of a replicated activation.  Tolerances:
tests/harness/tolerances.py (the masks themselves are compared exactly)."""

import pytest
import torch

from harness import dist_pool_fixture
from harness.parity import LlamaBuild, TokenBatches, check_training

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

P = 0.1

PARITY_2 = [("single", "dp=2"), ("ddp", "dp=2"), ("zero1", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2"),
            ("tp_sp", "tp=2")]
PARITY_4 = [("ddp", "dp=4"), ("fsdp_tp", "fsdp=2,tp=2")]


def _ok(res):
    """check_training raised on any loss, gradient, parameter or optimizer-state mismatch;
    here: every rank saw the same losses, and the dropout really is on (the same first
    micro-batch without it has another loss)."""
    assert all(r["loss"] == res[0]["loss"] for r in res), "ranks disagree on the loss"
    assert all(abs(r["loss"]["sgd"][0] - r["nodrop_loss"]) > 1e-4 for r in res), res


def _step(layout, mesh, **kw):
    """check_training (plain SGD, 2 steps of 2 micro-batches) of a Llama with dropout, and
    the first micro-batch's loss of the same model without dropout."""
    from meshlm.models import Llama, llama_config

    out = check_training(layout, mesh, build=LlamaBuild(overrides=(("dropout", P),)), optims=("sgd",), steps=2,
                         **kw)
    args, _kw = TokenBatches()(1, 0)
    out["nodrop_loss"] = float(Llama(llama_config("llama_tiny")).forward(*args))
    return out


@pytest.mark.parametrize("layout,mesh", PARITY_2, ids=[f"{l}-{m}" for l, m in PARITY_2])
def test_dropout_parity_2(pool2, layout, mesh):
    _ok(pool2.run(_step, layout, mesh))


@pytest.mark.parametrize("layout,mesh", PARITY_4, ids=[f"{l}-{m}" for l, m in PARITY_4])
def test_dropout_parity_4(pool4, layout, mesh):
    _ok(pool4.run(_step, layout, mesh))


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("tp_sp", "tp=2")])
def test_dropout_parity_compiled_aot_eager(pool2, layout, mesh):
    """Compiled blocks draw the keys eager draws: fsdp re-gathers under a compiled
    selective checkpoint (its recompute must not draw a new key), tp_sp drops a
    sequence-sharded DTensor."""
    _ok(pool2.run(_step, layout, mesh, compile="aot_eager"))


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("tp", "tp=2")])
def test_dropout_parity_activation_checkpointing(pool2, layout, mesh, mode):
    """train.activation_checkpointing recomputes each block in backward: the recompute
    must draw the keys (and so the masks) of the forward, or the gradients are wrong."""
    _ok(pool2.run(_step, layout, mesh, activation_checkpointing=mode))


def _step_recompute(layout, mesh):
    """An eager ZeRO-3 block that re-gathers by recomputing its forward (meshlm's own
    checkpoint, NOTE [re-gather in backward]) rather than by freeing."""
    from meshlm.runtime.lowering import blocks

    prev, blocks.EAGER_REGATHER = blocks.EAGER_REGATHER, "recompute"
    try:
        return _step(layout, mesh)
    finally:
        blocks.EAGER_REGATHER = prev


def test_dropout_parity_regather_recompute(pool2):
    _ok(pool2.run(_step_recompute, "fsdp", "fsdp=2"))


def _no_grad_loss(layout, mesh_shape):
    """A training-mode forward under torch.no_grad: the root runs under DTensor and the
    blocks on local rows inside it (NOTE [local root]), so dropout must learn that the plain
    tensors there are this rank's rows from the block, not from the root."""
    import meshlm
    from meshlm.runtime.lowering import shard_state
    from meshlm.models import Llama, llama_config

    cfg = llama_config("llama_tiny", dropout=P)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab, (8, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab, (8, 16), generator=gen)
    torch.manual_seed(0)
    with torch.no_grad():
        ref = float(Llama(cfg, seed=0)(tokens, labels))
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        loss = float(model(meshlm.shard_batch(tokens, layout, mesh), meshlm.shard_batch(labels, layout, mesh)))
    assert shard_state(model).roots == {"local": 0, "dtensor": 1}, "expected the DTensor root"
    return loss, ref


def test_dropout_no_grad_dtensor_root_local_blocks(pool2):
    for loss, ref in pool2.run(_no_grad_loss, "ddp", "dp=2"):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)


def _masks(layout, mesh_shape, p=0.5):
    """Every keep-mask a forward of the sharded model computes on this rank, and those of
    the one-device model (the same forward, same keys)."""
    import meshlm
    from meshlm.core import rng
    from meshlm.models import Llama, llama_config

    cfg = llama_config("llama_tiny", dropout=p)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab, (8, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab, (8, 16), generator=gen)
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    orig, seen = rng.keep_mask, []

    def record(*args, **kwargs):
        m = orig(*args, **kwargs)
        seen.append(m.clone())
        return m

    rng.keep_mask = record
    try:
        torch.manual_seed(0)
        Llama(cfg, seed=0)(tokens, labels)
        ref, seen[:] = list(seen), []
        torch.manual_seed(0)
        model(meshlm.shard_batch(tokens, layout, mesh), meshlm.shard_batch(labels, layout, mesh))
    finally:
        rng.keep_mask = orig
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    return {"coord": coord, "masks": seen, "ref": ref}


def _check_masks(res, data_axis, seq_axis=None):
    """Rank with data coordinate d holds rows d of the batch (and, with ``seq_axis``,
    positions s of the sequence, s its coordinate there): its masks are exactly the
    one-device masks there.  Ranks with different data coordinates drop different elements;
    ranks with the same one (and the same seq block) drop the same ones."""
    n_calls = 2 * 2  # two layers, two residual dropouts each
    for r in res:
        assert len(r["masks"]) == len(r["ref"]) == n_calls
        d = r["coord"].get(data_axis, 0)
        s = r["coord"].get(seq_axis, 0) if seq_axis else 0
        for m, full in zip(r["masks"], r["ref"]):
            rows = full.shape[0] // len({q["coord"].get(data_axis, 0) for q in res})
            pos = full.shape[1] // len({q["coord"].get(seq_axis, 0) for q in res}) if seq_axis else full.shape[1]
            assert torch.equal(m, full[d * rows:(d + 1) * rows, s * pos:(s + 1) * pos]), r["coord"]
    for a in res:
        for b in res:
            same = a["coord"].get(data_axis, 0) == b["coord"].get(data_axis, 0) and (
                seq_axis is None or a["coord"][seq_axis] == b["coord"][seq_axis])
            for ma, mb in zip(a["masks"], b["masks"]):
                assert torch.equal(ma, mb) == same, (a["coord"], b["coord"])


def test_masks_differ_over_dp_2(pool2):
    _check_masks(pool2.run(_masks, "ddp", "dp=2"), "dp")


def test_masks_differ_over_dp_4(pool4):
    _check_masks(pool4.run(_masks, "ddp", "dp=4"), "dp")


def test_masks_same_over_tp(pool2):
    """tp: the residual stream is replicated over tp, so both ranks drop the same elements."""
    res = pool2.run(_masks, "tp", "tp=2")
    _check_masks(res, "dp")
    assert all(torch.equal(a, b) for a, b in zip(res[0]["masks"], res[1]["masks"]))


def test_masks_sequence_parallel(pool2):
    """tp_sp: the residual stream is sequence-sharded over tp: each rank drops the
    one-device mask of its positions."""
    _check_masks(pool2.run(_masks, "tp_sp", "tp=2"), "dp", "tp")


def test_masks_fsdp_tp(pool4):
    """2-D: the same mask within a tp group, different ones across fsdp."""
    _check_masks(pool4.run(_masks, "fsdp_tp", "fsdp=2,tp=2"), "fsdp")


# Inductor with dropout: tests/dist/test_parity.py::test_parity_compiled_inductor.
