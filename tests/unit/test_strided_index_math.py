"""A strided shard's index arithmetic (``_StridedShard.local_shard_size_and_offset``, what
DTensor runs for the rows of a flattened (batch, sequence) split over cp) stays out of a
traced graph under ``meshlm._torch_compat.dtensor_index_math_untraced`` (NOTE [compiled cp]
in meshlm/runtime/compile.py), and gives the sizes and offsets torch computes eagerly."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from meshlm import _torch_compat as compat

placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
StridedShard = getattr(placement_types, "_StridedShard", None)


def _traced(context, rank: int):
    """The graph make_fx records for a function that adds a strided shard's local size and
    offset (8 rows as 2 x 4, split over 2 ranks) to its input."""
    p = StridedShard(0, split_factor=2)

    def f(x):
        size, offset = p.local_shard_size_and_offset(8, 2, rank)
        return x + size + offset

    with context():
        return make_fx(f, tracing_mode="fake")(torch.zeros(3))


@pytest.mark.skipif(StridedShard is None, reason="this torch has no _StridedShard")
@pytest.mark.parametrize("rank", [0, 1])
def test_strided_index_math_is_not_traced(rank):
    size, offset = StridedShard(0, split_factor=2).local_shard_size_and_offset(8, 2, rank)  # eager: plain torch
    g = _traced(compat.dtensor_index_math_untraced, rank)
    ops = {n.target for n in g.graph.nodes if n.op == "call_function"}
    assert ops == {torch.ops.aten.add.Tensor}, ops  # no arange, split or read-back of indices
    assert torch.equal(g(torch.zeros(3)), torch.zeros(3) + size + offset)


@pytest.mark.skipif(StridedShard is None, reason="this torch has no _StridedShard")
def test_the_patch_is_undone_on_exit():
    before = StridedShard.__dict__["local_shard_size_and_offset"]
    with compat.dtensor_index_math_untraced():
        assert StridedShard.__dict__["local_shard_size_and_offset"] is not before
    assert StridedShard.__dict__["local_shard_size_and_offset"] is before
