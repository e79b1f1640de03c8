"""Every module-level object of meshlm that can change, where it lives and why: the one
inventory (``INVENTORY``, and ``READ_ONLY`` for the tables nothing changes after import).

A sharded model keeps what it needs at run time on objects it owns (its ``ShardState``:
the blocks' ``Prefetch``, the gradient reductions it left ``InFlight``, the gathers kept
through a pipeline step, its counters; the optimizer: main gradients and masters), and
what the code running now is doing in one run-state object, ``meshlm.core.state.RUN``
(NOTE [run state] in meshlm/core/state.py).  What remains module-level is listed here:

NOTE [process-wide tables]
    A few tables must be the process's, not a model's:

    - Tables that compiled graphs refer to by index (``BUCKETS``, ``_AT_USE``) or by the
      object (``_SPECS``, the sharded classes).  A block compiled by torch.compile takes a
      bucket's or a parameter's key as an int constant (torch 2.11's Dynamo cannot pass a
      Placement or a DeviceMesh into an allow_in_graph function) and guards on its block
      spec and class; equal values are interned to one key, one spec and one class, so
      that every layer of a block class and every equal model on the same ranks share one
      compiled graph.  A table of a model's own would give each model its own keys and
      compile every block class again for each.  They grow with the distinct kinds of
      blocks and parameters, not with layers or models.  ``BUCKETS`` is the one whose
      values hold something of a model (a DeviceMesh, and through it process groups): a
      slot holds its bucket while a model that registered it lives (``weakref.finalize``
      on its ShardState) and None after, its index kept for an equal bucket; the at-use
      entries and block specs are placements, dtypes, ints and names only.
    - torch patches (meshlm/_torch_compat/): DTensor's dispatcher entries are the
      process's, so what meshlm adds to them is too.
    - Caches of things that cost to make and are the same for every caller (compiled
      decode steps, plans, view placements), each bounded or weak.
    - Process resources: the checkpoint-directory locks this process holds, swap
      directories to close at exit, the sweep a Hydra multirun is running.

    The run state itself (``RUN``) is process-wide for Dynamo's sake (NOTE [run state]).
    tests/unit/test_run_state.py checks that this inventory is complete (every module-level
    list, dict, set, context variable, weak container, lru_cache and ``global`` statement of
    meshlm is declared here), that read-only tables are never written, and that a
    collected model leaves nothing of itself in the tables.
"""

from __future__ import annotations

RUN_STATE = "run state"  # NOTE [run state]
TABLE = "process-wide table"  # referred to from compiled graphs: NOTE [process-wide tables]
PATCH = "torch patch"  # what meshlm installs into torch's own tables
CACHE = "cache"
RESOURCE = "process resource"
SWITCH = "switch"  # a module attribute a benchmark sets

# "path:name" -> (kind, why it is module-level, and what bounds it)
INVENTORY: dict[str, tuple[str, str]] = {
    # ------------------------------------------------------------------ the run state
    "meshlm/core/state.py:RUN": (
        RUN_STATE,
        "what the code running now is doing (handler, rows, gathering, local_root, site, stage, on_use, fake_eager); "
        "a plain object that traced code reads and Dynamo guards on; every field back at its default outside scopes",
    ),
    # ------------------------------------------------------------------ tables compiled graphs refer to
    "meshlm/runtime/bucket/spec.py:BUCKETS": (
        TABLE,
        "bucket index -> Bucket, the index an int constant in compiled blocks; interned by content; a slot is "
        "emptied when the last model that registered it is collected",
    ),
    "meshlm/runtime/bucket/spec.py:_OWNERS": (TABLE, "per BUCKETS slot, how many live models registered it"),
    "meshlm/runtime/bucket/spec.py:_FREE": (
        TABLE,
        "a bucket's identity without its mesh (names and sizes) -> empty slots an equal bucket takes again; "
        "bounded by the distinct buckets",
    ),
    "meshlm/runtime/bucket/spec.py:_BY_OWNER": (
        TABLE,
        "id(ShardState) -> (its finalizer, the slots it holds); an entry leaves when its ShardState is collected",
    ),
    "meshlm/runtime/lowering/atuse.py:_AT_USE": (
        TABLE,
        "at-use key -> (compute and grads placements, dtypes, regather), the key an int constant in compiled "
        "blocks; plain values interned by content, bounded by the distinct combinations",
    ),
    "meshlm/runtime/lowering/atuse.py:_AT_USE_KEYS": (TABLE, "the inverse of _AT_USE, for interning"),
    "meshlm/runtime/lowering/blocks.py:_SPECS": (
        TABLE,
        "one BlockSpec object per content, so that Dynamo's guards on a block's spec hold for every layer; "
        "plain values (a bucket key, paths, rows), bounded by the distinct block kinds",
    ),
    "meshlm/runtime/hooks.py:_DERIVED": (
        TABLE,
        "one derived class (Sharded<Name>, Offloaded<Name>, Staged<Name>) per (base class, prefix, key): every "
        "instance shares its code, so compiled blocks of one class share a graph; per class, not per model",
    ),
    # ------------------------------------------------------------------ torch patches (meshlm/_torch_compat)
    "meshlm/_torch_compat/dtensor_alltoall.py:_STOCK": (
        PATCH,
        "torch's shard_dim_alltoall, kept once replaced: called for GPU meshes and meshes meshlm did not make "
        "(NOTE [cpu all-to-all])",
    ),
    "meshlm/_torch_compat/dtensor_costs.py:_STOCK": (
        PATCH,
        "torch's redistribute_cost, kept once replaced: called on meshes of one or two dims and meshes meshlm "
        "did not make (NOTE [strided costs])",
    ),
    "meshlm/_torch_compat/dtensor_ops.py:_MINE": (
        PATCH,
        "the DTensor dispatcher entries meshlm installs; torch's dispatcher is the process's",
    ),
    "meshlm/_torch_compat/dtensor_ops.py:_installed": (PATCH, "whether _MINE is installed (once per process)"),
    "meshlm/_torch_compat/__init__.py:_PENDING_IN_GRAPH": (
        PATCH,
        "functions marked allow_in_graph before Dynamo was imported, registered by shard (NOTE [lazy dynamo])",
    ),
    "meshlm/_torch_compat/dtensor_ops.py:_BELOW": (
        PATCH,
        "per op, the handler stock torch has under meshlm's (torch's loss_parallel() handlers while such a "
        "block is open), called for DTensors on meshes meshlm did not make (NOTE [scoped patches])",
    ),
    "meshlm/_torch_compat/dtensor_replication.py:_local": (
        PATCH,
        "the stock implicit-replication flag, per thread, where torch has no C++ stash for it (NOTE [scoped patches])",
    ),
    "meshlm/_torch_compat/dtensor_replication.py:_orig_replicate": (
        PATCH,
        "the dispatcher method meshlm's replication gate wraps, called for meshes meshlm did not make; set once",
    ),
    "meshlm/_torch_compat/dtensor_cp.py:_MESHES": (
        TABLE,
        "each sharded model's cp settings (a cp axis of size > 1; NOTE [cp dispatch]); among equal meshes the "
        "last entry is in force, each model's put last by its forward and backward (NOTE [cp settings per model] "
        "in meshlm/runtime/cp/active.py); an entry goes when its model is collected",
    ),
    "meshlm/runtime/cp/active.py:_OPEN": (
        TABLE,
        "the cp models whose backward hooks ran in the backward pass running now, with its graph task id, to "
        "refuse one pass through two models of different balance (NOTE [cp settings per model])",
    ),
    "meshlm/_torch_compat/dtensor_cp.py:_ORIGINAL": (
        PATCH,
        "torch's redistribute_local_tensor, wrapped once for meshes with balanced cp chunks (NOTE [balanced chunks])",
    ),
    "meshlm/_torch_compat/dtensor_scope.py:_MESHES": (
        TABLE,
        "the device meshes meshlm made or sharded onto, by object id, weakly held: meshlm's DTensor rules act on "
        "these and meshes equal to them only (NOTE [scoped patches]); a mesh leaves when it is collected",
    ),
    "meshlm/_torch_compat/dtensor_views.py:_strided_view_placements": (
        CACHE,
        "lru_cache (256 entries) of view placements by (op, mesh, placements, shapes, dtype)",
    ),
    # ------------------------------------------------------------------ caches
    "meshlm/infer/compiled.py:_COMPILED": (
        CACHE,
        "the shared decode step per torch.compile backend: one graph cache for every model (NOTE [compiled decode]); "
        "one entry per backend",
    ),
    "meshlm/infer/compiled.py:_FROZEN": (
        CACHE,
        "a model's frozen decode step (NOTE [frozen decode]), weakly keyed by the model: it goes with the model",
    ),
    "meshlm/plan/state.py:_PLAN_CACHE": (
        CACHE,
        "per-parameter plans by (config, layout, mesh sizes): the planner's search asks for the same ones "
        "many times; emptied past 4096 entries",
    ),
    "meshlm/plan/state.py:_MODELS": (
        CACHE,
        "one one-layer meta Llama per config, for _PLAN_CACHE (no data; one per config planned)",
    ),
    # ------------------------------------------------------------------ process resources
    "meshlm/train/checkpoint/lock.py:_HELD": (
        RESOURCE,
        "this process's checkpoint-directory locks: a flock belongs to the open file, so a second open in this "
        "process would find its own lock held (NOTE [one writer per checkpoint directory]); an entry leaves on "
        "its last release",
    ),
    "meshlm/runtime/offload/store.py:_OPEN": (
        RESOURCE,
        "swap directories not yet closed, for close_all when a worker leaves through os._exit; weak",
    ),
    "meshlm/app/cli.py:_SWEEP": (
        RESOURCE,
        "the Hydra multirun in progress (its directory, jobs run, jobs failed): Hydra calls the command once per "
        "job, with nothing else to carry it between calls; reset per invocation",
    ),
    # ------------------------------------------------------------------ switches
    "meshlm/runtime/lowering/blocks.py:EAGER_REGATHER": (
        SWITCH,
        "how an eager re-gathering block re-gathers: a switch for benchmarks/step_phases.py, not a setting",
    ),
}

# Tables filled at import and never written after (checked: no code of meshlm assigns to,
# deletes from or calls a mutating method on them).  path -> names; ``__all__`` is everywhere.
READ_ONLY: dict[str, str] = {
    "meshlm/__init__.py": "_HOME",
    "meshlm/_torch_compat/dcp_metadata.py": "_CLASSES",
    "meshlm/_torch_compat/dtensor_loss.py": "_MEAN_LOSS_BACKWARD",
    "meshlm/app/cli.py": "COMMANDS",
    "meshlm/app/config.py": "_SECTIONS RETIRED_KEYS",
    "meshlm/app/infer_plan.py": "DTYPES",
    "meshlm/app/run_report.py": "BUILDS",
    "meshlm/app/grammar.py": "VALUED SWITCHES",
    "meshlm/app/tracking.py": "BACKENDS",
    "meshlm/core/axes.py": "LOGICAL_AXES",
    "meshlm/core/state.py": "DEFAULTS",
    "meshlm/data/shapes.py": "COLOURS PLACES CORNERS",
    "meshlm/infer/compiled.py": "FROZEN_OPTIONS",
    "meshlm/interop/hf/family.py": "_FAMILIES",
    "meshlm/interop/hf/llama.py": "_LAYER _TOP",
    "meshlm/interop/hf/llava.py": "_VISION_TOP _VISION_LAYER",
    "meshlm/interop/hf/mixtral.py": "_EXPERT",
    "meshlm/interop/hf/qwen_moe.py": "_EXPERT _ONE",
    "meshlm/interop/hf/save.py": "_DT_TO_ST",
    "meshlm/layout/offload.py": "KINDS",
    "meshlm/layout/precision.py": "DTYPES",
    "meshlm/models/__init__.py": "_HOME",
    "meshlm/models/gpt2.py": "CONFIGS",
    "meshlm/models/llama.py": "CONFIGS",
    "meshlm/models/moe.py": "CONFIGS",
    "meshlm/models/node.py": "SHIPPED_FIELDS",
    "meshlm/models/vlm.py": "CONFIGS",
    "meshlm/plan/hardware.py": "HARDWARE",
    "meshlm/runtime/comm.py": "_FUNCTIONAL _FUNCTIONAL_COALESCED _C10D _P2P _SEEN_INSIDE",
    "meshlm/runtime/lowering/policies.py": "SAVED_OPS SAVED_COLLECTIVES",
    "meshlm/runtime/optim/sharded.py": "_ELEMENTWISE",
    "meshlm/runtime/pipeline/schedule.py": "SCHEDULES",
    "meshlm/runtime/state.py": "INVENTORY READ_ONLY",
    "meshlm/train/checkpoint/__init__.py": "_HOME",
    "meshlm/train/diff/record.py": "PHASE",
    "meshlm/train/checkpoint/config.py": "_RESUME_WORDS",
    "meshlm/train/lifecycle.py": "_REFERENCE_TARGETS",
}
