"""``meshlm.root``: the sharded root's public names, kept for code written against the
module they used to live in; see ``meshlm.lowering.root`` and ``meshlm.lowering.local_root``."""

from meshlm.lowering.inputs import input_axes, shard_batch, wrap_input
from meshlm.lowering.local_root import LocalHandler, RootSpec
from meshlm.lowering.root import root_forward

__all__ = ["LocalHandler", "RootSpec", "input_axes", "root_forward", "shard_batch", "wrap_input"]
