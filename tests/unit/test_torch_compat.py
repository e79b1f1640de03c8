"""Every private torch API meshlm uses goes through ``meshlm._torch_compat`` (its module
docstring says why): no other module of meshlm names one.  Read from the source (the AST,
so docstrings and comments do not count), so it needs no torch build of any version."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "meshlm" / "_torch_compat"
# Private attributes of torch objects that are not reached through a ``torch.`` chain.
PRIVATE_ATTRS = {"_local_tensor", "_spec", "_op_dispatcher", "_execution_engine", "_cdata"}


def _private(dotted: str) -> bool:
    """A dotted torch name with a private part (``torch._dynamo``, ``torch.ops._c10d_functional``)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch API that ``source`` names."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name is not None and _private(name) and not _private(name.rpartition(".")[0]):
                out.append((node.lineno, name))
            elif node.attr in PRIVATE_ATTRS or node.attr.startswith("_saved_"):
                out.append((node.lineno, f"._{node.attr[1:]}"))
    return out


@pytest.mark.parametrize(
    "snippet, caught",
    [
        ("import torch._dynamo", True),
        ("from torch.distributed import _functional_collectives as funcol", True),
        ("from torch.distributed.tensor._dtensor_spec import DTensorSpec", True),
        ("x = torch.ops._c10d_functional.wait_tensor", True),
        ("torch._C._current_graph_task_id()", True),
        ("y = t._local_tensor", True),
        ("w = node._saved_total_weight", True),
        ("from torch.distributed.tensor import DTensor, Shard", False),
        ("torch.compiler.is_compiling(); torch.__version__; torch.ops.aten.mm.default", False),
        ('"""torch._dynamo in a docstring"""  # and torch._C in a comment', False),
    ],
)
def test_private_uses_sees_what_it_should(snippet, caught):
    assert bool(private_uses(snippet)) is caught, snippet


def test_no_private_torch_api_outside_the_compat_package():
    found = []
    for path in sorted((REPO / "meshlm").rglob("*.py")):
        if COMPAT in path.parents:
            continue
        for line, what in private_uses(path.read_text()):
            found.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not found, (
        "private torch APIs outside meshlm/_torch_compat/ (wrap each there, with its version "
        "differences, and call the wrapper):\n" + "\n".join(found)
    )
