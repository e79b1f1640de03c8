"""meshlm: write a model once against logical axes; shard it by swapping a YAML layout.

The names below load on first use (PEP 562): ``import meshlm`` alone imports neither torch
nor DTensor, so the ``meshlm`` command can start a run's worker processes while it is still
importing them itself (docs/train.md, "Start-up time").
"""

from meshlm.core.lazy import lazy_names

# public name -> the module that defines it
_HOME = {
    "nn": "meshlm.nn",  # annotated Linear, Embedding, LayerNorm, RMSNorm, Dropout
    **dict.fromkeys(
        ("block", "constrain", "declare_axes", "dropout", "init_params", "reduce_batch", "set_axes"),
        "meshlm.core.annotate",
    ),
    **dict.fromkeys(("LOGICAL_AXES", "MESH_AXES", "Axes"), "meshlm.core.axes"),
    **dict.fromkeys(
        (
            "AnnotationError",
            "AxisError",
            "CheckpointError",
            "ConfigError",
            "LayoutError",
            "MeshError",
            "MeshlmError",
        ),
        "meshlm.core.errors",
    ),
    **dict.fromkeys(("Layout", "load_layout", "resolve"), "meshlm.layout.rules"),
    **dict.fromkeys(("full_state_dict", "plan_params", "shard"), "meshlm.runtime.lowering"),
    **dict.fromkeys(("MeshSpec", "make_mesh"), "meshlm.layout.mesh"),
    "shard_batch": "meshlm.runtime.lowering.inputs",
    "load_hf": "meshlm.interop.hf.load",
    "ShardedOptimizer": "meshlm.runtime.optim.sharded",
    "unshard": "meshlm.runtime.unshard",  # the plain module back (docs/unshard.md)
}


__getattr__, __dir__ = lazy_names("meshlm", globals(), _HOME)


__all__ = [
    "Axes",
    "LOGICAL_AXES",
    "MESH_AXES",
    "block",
    "constrain",
    "dropout",
    "reduce_batch",
    "init_params",
    "Layout",
    "set_axes",
    "declare_axes",
    "nn",
    "load_layout",
    "resolve",
    "make_mesh",
    "load_hf",
    "MeshSpec",
    "shard",
    "shard_batch",
    "ShardedOptimizer",
    "unshard",
    "plan_params",
    "full_state_dict",
    "MeshlmError",
    "AxisError",
    "LayoutError",
    "AnnotationError",
    "MeshError",
    "ConfigError",
    "CheckpointError",
]
__version__ = "0.1.0"
