"""meshlm: write a model once against logical axes; shard it by swapping a YAML layout."""

from meshlm.annotate import block, constrain, init_params
from meshlm.axes import LOGICAL_AXES, MESH_AXES, Axes
from meshlm.errors import (AnnotationError, AxisError, CheckpointError, ConfigError, LayoutError, MeshError,
                           MeshlmError)
from meshlm.layout import Layout, load_layout, resolve
from meshlm.lower import full_state_dict, plan_params, shard, shard_batch
from meshlm.mesh import MeshSpec, make_mesh

__all__ = [
    "Axes", "LOGICAL_AXES", "MESH_AXES", "block", "constrain", "init_params", "Layout", "load_layout",
    "resolve", "make_mesh", "MeshSpec", "shard", "shard_batch", "plan_params", "full_state_dict",
    "MeshlmError", "AxisError", "LayoutError", "AnnotationError", "MeshError", "ConfigError", "CheckpointError",
]
__version__ = "0.1.0"
