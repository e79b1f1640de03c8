"""``meshlm.lower``: the lowering's public names, kept for code written against the single
module it used to be.  The lowering lives in the package ``meshlm.lowering`` (one idea per
file; its docstring gives the steps and the dependency direction)."""

from meshlm.annotate import outer_blocks as _outer_blocks
from meshlm.lowering import (
    ParamPlan,
    ShardState,
    full_state_dict,
    iter_params,
    keep_constraints,
    local_box,
    local_slice,
    placements,
    plan_params,
    shard,
    shard_state,
)
from meshlm.lowering.params import pure_data_parallel as _pure_data_parallel

# ``_pure_data_parallel`` and ``_outer_blocks``: names the planner and older branches import.
__all__ = [
    "ParamPlan",
    "ShardState",
    "_outer_blocks",
    "_pure_data_parallel",
    "full_state_dict",
    "iter_params",
    "keep_constraints",
    "local_box",
    "local_slice",
    "placements",
    "plan_params",
    "shard",
    "shard_state",
]
