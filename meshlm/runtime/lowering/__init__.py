"""Lowering: model + Layout + DeviceMesh -> DTensor parameters and redistributes.

``shard`` does, in place:

1. plans every parameter (``params.plan_params``): its logical axes resolved under the
   layout's ``params``, ``compute``, ``grads`` and ``optimizer`` sections;
2. materialises each rank's shard only (``materialize``: from a seed by replaying the
   canonical init order one module at a time, or sliced from real weights that every rank
   holds);
3. swaps each module's class for a subclass, ``Sharded<its class>`` (NOTE [sharded class
   names] and NOTE [attachments] in meshlm/runtime/hooks.py: ``meshlm.unshard`` undoes it),
   whose parameter attributes redistribute the stored DTensor to its compute placements at use (SimpleFSDP's gather-at-use), through
   ``atuse.AtUse``, whose backward reduces the gradient to the layout's ``grads``
   placements, so the all-gather and the reduce-scatter are ordinary autograd-traced ops;
4. gives each block one bucket (``blocks``; NOTE [block buckets] in meshlm/runtime/bucket/) and a
   way to re-gather in backward (``policies``: NOTE [re-gather in backward]);
5. wraps the root forward (``root``): every tensor leaf of the inputs (each rank's local
   slice, ``inputs``) becomes a DTensor per the input rules, ``constrain`` points
   redistribute activations, plain tensors made inside forward are treated as replicated,
   and a scalar loss comes back as a plain tensor.  Under a pure data-parallel layout the
   root runs on local tensors instead and its outputs are lifted back (``local_root``,
   NOTE [local root] in local_root.py).  Buffers stay whole on every rank (NOTE [buffers] in buffers.py).

All per-model state lives in one ``ShardState`` (``state``) attached to the root module
(``model._meshlm_state``); what a module needs at run time is on that module.  The only
process-wide tables hold immutable values interned by content (sharded classes, bucket
and at-use specs), which compiled code refers to by identity or index.

Parameter names (FQNs) are those of the unsharded model.

Dependency direction: each file imports only the files below it (and meshlm.runtime.bucket,
meshlm._torch_compat and the vocabulary modules), never one above:

    shard.py        shard(): the steps above, the sharded classes
    root.py         the root forward (DTensor root, or the local root)
    local_root.py   the local root and the lifting of its outputs
    inputs.py       input axes, shard_batch, wrapping inputs as DTensors
    materialize.py  each rank's shards from a seed or from real weights
    buffers.py      buffers: whole on every rank, averaged where a forward changed them
    blocks.py       the block runtime: bucket at entry, free or checkpoint to re-gather
    policies.py     checkpoint policies, keep_constraints
    atuse.py        gather at use (AtUse) and the parameter getters
    state.py        ShardState: the one per-model state object
    params.py       ParamPlan, plan_params, placements, local_box / local_slice
"""

from meshlm.runtime.lowering.inputs import input_axes, shard_batch
from meshlm.runtime.lowering.params import (
    ParamPlan,
    full_state_dict,
    iter_params,
    local_box,
    local_slice,
    placements,
    plan_params,
    pure_data_parallel,
)
from meshlm.runtime.lowering.policies import keep_constraints
from meshlm.runtime.lowering.shard import shard
from meshlm.runtime.lowering.state import ShardState, shard_state

__all__ = [
    "ParamPlan",
    "ShardState",
    "full_state_dict",
    "input_axes",
    "iter_params",
    "keep_constraints",
    "local_box",
    "local_slice",
    "placements",
    "plan_params",
    "pure_data_parallel",
    "shard",
    "shard_batch",
    "shard_state",
]
