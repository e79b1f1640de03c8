"""The logical-axis vocabulary.

A logical axis names the *role* of a tensor dim (``embed``, ``heads``, ...); a mesh axis
names a dim of the device mesh (``dp``, ``fsdp``, ``tp``, ...).  Models speak only
logical axes; layouts map logical axes to mesh axes.  Both vocabularies are closed so a
typo is an error, never a silently replicated tensor.
"""

from __future__ import annotations

from typing import Optional, Tuple

#: One entry per tensor dim: a logical axis name, or ``None`` for "never sharded".
Axes = Tuple[Optional[str], ...]

LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a global batch",
    "seq": "token positions (queries)",
    "kv_seq": "key/value positions (same size as seq, different role)",
    "embed": "model width (hidden size)",
    "mlp": "feed-forward intermediate width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (grouped-query attention)",
    "head_dim": "width of one attention head",
    "vocab": "token vocabulary",
    "layers": "stacked transformer layers",
    "experts": "mixture-of-experts experts",
    "channels": "image or audio channels",
    "patch": "image patches / audio frames",
}

#: Mesh axes in canonical outer -> inner order.  Rank order is row-major in this order,
#: so the innermost (fastest varying) axis is ``ep``, then ``pp`` ... and ``dp`` outermost.
MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "cp", "pp", "ep")

#: Mesh axes over which the batch is split (ranks that differ only in other axes see the
#: same examples).
DATA_AXES: tuple[str, ...] = ("dp", "fsdp")


def check_logical(name: str, where: str) -> None:
    """Raise :class:`meshlm.errors.AxisError` unless ``name`` is a logical axis."""
    from meshlm.errors import AxisError

    if name not in LOGICAL_AXES:
        raise AxisError(
            f"{where}: unknown logical axis {name!r}. Logical axes are "
            f"{', '.join(LOGICAL_AXES)}. Fix the spelling, or add the axis to "
            "meshlm/axes.py:LOGICAL_AXES if your model needs a new role."
        )


def check_mesh(name: str, where: str) -> None:
    """Raise :class:`meshlm.errors.AxisError` unless ``name`` is a mesh axis."""
    from meshlm.errors import AxisError

    if name not in MESH_AXES:
        raise AxisError(
            f"{where}: unknown mesh axis {name!r}. Mesh axes are {', '.join(MESH_AXES)} "
            "(outer -> inner)."
        )
