"""meshlm: write a model once against logical axes; shard it by swapping a YAML layout."""

from meshlm import nn  # (meshlm.nn: annotated Linear, Embedding, LayerNorm, RMSNorm, Dropout)
from meshlm.annotate import block, constrain, declare_axes, dropout, init_params, reduce_batch, set_axes
from meshlm.axes import LOGICAL_AXES, MESH_AXES, Axes
from meshlm.errors import AnnotationError, AxisError, CheckpointError, ConfigError, LayoutError, MeshError, MeshlmError
from meshlm.layout import Layout, load_layout, resolve
from meshlm.lower import full_state_dict, plan_params, shard
from meshlm.mesh import MeshSpec, make_mesh
from meshlm.root import shard_batch


def load_hf(path, layout, mesh, **shard_kwargs):
    """Import a Hugging Face Llama or GPT-2 directory into a sharded meshlm model (see meshlm.hf)."""
    from meshlm.hf import load_hf as _load_hf

    return _load_hf(path, layout, mesh, **shard_kwargs)


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
