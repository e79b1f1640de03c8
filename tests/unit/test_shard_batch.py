"""``meshlm.shard_batch``: each rank's slice of a global batch, on fake meshes in which this
process is each rank in turn.  The slice must be the block of the global batch that the
layout's input rules give this rank's mesh coordinates (data axes outer to inner, ranks that
differ only in tp reading the same rows), for every leaf of a container, by the axes given
for its path; a batch the mesh does not divide is refused, naming the leaf."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshlm
from harness.simworld import fake_mesh
from meshlm.layout.rules import parse_layout


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _mesh(shape: dict, rank: int):
    mesh = fake_mesh(shape, rank)
    assert dist.get_rank() == rank
    return mesh


def _batch():
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(0, 100, (8, 6), generator=g),
        "extra": {"labels": torch.arange(8), "pos": [torch.arange(48).view(8, 6)]},
        "class_weight": torch.rand(3, generator=g),
        "seq_first": torch.arange(48).view(6, 8),
        "onehot": torch.arange(32).view(8, 4),
    }


# "vocab" is split over tp by the tp layout, but inputs only over dp, fsdp and cp: the ranks
# of a tp group read the same examples, whole.
AXES = {"class_weight": (None,), "seq_first": ("seq", "batch"), "onehot": ("batch", "vocab")}


@pytest.mark.parametrize(
    "layout, shape, block_of",
    [
        ("tp", {"dp": 2, "tp": 2}, lambda r: r // 2),  # rows over dp; the tp pair reads the same
        ("ddp", {"dp": 2, "fsdp": 2}, lambda r: r),  # rows over dp then fsdp (outer -> inner)
        ("fsdp", {"fsdp": 4}, lambda r: r),
    ],
)
def test_each_rank_gets_its_block_of_rows(layout, shape, block_of):
    full = _batch()
    for rank in range(4):
        got = meshlm.shard_batch(full, layout, _mesh(shape, rank), AXES)
        n = 4 if layout != "tp" else 2
        rows = slice(block_of(rank) * 8 // n, (block_of(rank) + 1) * 8 // n)
        assert torch.equal(got["tokens"], full["tokens"][rows])
        assert torch.equal(got["extra"]["labels"], full["extra"]["labels"][rows])
        assert torch.equal(got["extra"]["pos"][0], full["extra"]["pos"][0][rows])
        assert torch.equal(got["class_weight"], full["class_weight"])  # no batch axis: whole
        assert torch.equal(got["seq_first"], full["seq_first"][:, rows])
        assert got["seq_first"].is_contiguous()  # a column block, copied out
        assert torch.equal(got["onehot"], full["onehot"][rows])
        assert type(got["extra"]["pos"]) is list


def test_context_parallel_splits_the_sequence_too():
    layout = parse_layout(
        {"params": {}, "compute": {"batch": ["dp"], "seq": "cp"}, "context": {"balance": False}}, name="dp_cp"
    )
    full = torch.arange(8 * 6).view(8, 6)
    for rank in range(4):
        dp, cp = divmod(rank, 2)
        got = meshlm.shard_batch(full, layout, _mesh({"dp": 2, "cp": 2}, rank))
        assert torch.equal(got, full[dp * 4 : dp * 4 + 4, cp * 3 : cp * 3 + 3]) and got.is_contiguous()
        # one tuple of axes for every leaf
        (one,) = meshlm.shard_batch([full[:, 0]], layout, _mesh({"dp": 2, "cp": 2}, rank), ("batch",))
        assert torch.equal(one, full[dp * 4 : dp * 4 + 4, 0])


def test_balanced_context_parallel_gives_each_rank_a_head_and_a_tail_chunk():
    """NOTE [balanced chunks]: of 2*cp chunks, cp rank r gets chunks r and 2*cp-1-r."""
    layout = parse_layout({"params": {}, "compute": {"batch": ["dp"], "seq": "cp"}}, name="dp_cp")
    full = torch.arange(4 * 16).view(4, 16)
    for rank in range(4):
        dp, cp = divmod(rank, 2)
        got = meshlm.shard_batch(full, layout, _mesh({"dp": 2, "cp": 2}, rank))
        rows = full[dp * 2 : dp * 2 + 2]
        want = torch.cat([rows[:, cp * 4 : cp * 4 + 4], rows[:, (3 - cp) * 4 : (4 - cp) * 4]], dim=1)
        assert torch.equal(got, want) and got.is_contiguous()
    with pytest.raises(meshlm.LayoutError) as e:
        meshlm.shard_batch(torch.zeros(4, 6), layout, _mesh({"dp": 2, "cp": 2}, 0))
    assert "multiple of 2*cp = 4" in str(e.value) and "context.balance" in str(e.value)


def test_a_batch_the_mesh_does_not_divide_is_refused_by_leaf():
    mesh = _mesh({"fsdp": 4}, 0)
    with pytest.raises(meshlm.MeshlmError) as e:
        meshlm.shard_batch({"tokens": torch.zeros(8, 6), "extra": {"labels": torch.zeros(6)}}, "fsdp", mesh)
    msg = str(e.value)
    assert msg.startswith("input `extra.labels` ('batch',) of shape (6,) axis 'batch' (size 6) is not divisible")
    assert "fsdp (size 4)" in msg and "layouts/fsdp.yaml: compute.batch" in msg
    with pytest.raises(meshlm.MeshlmError) as e:
        meshlm.shard_batch(torch.zeros(6, 2), "fsdp", mesh)
    assert str(e.value).startswith("input ('batch', 'seq') of shape (6, 2) axis 'batch'")
