"""meshlm's packages form layers, and imports flow one way: down (docs/architecture.md).

Every import counts, including the ones inside functions: a lazy import hides a dependency
from Python, not from the reader.  Three rules, each checked on the whole source tree and
each shown to catch a planted violation:

- a module imports only its own layer's package or the layers below it (never a peer
  package of the same layer: train, infer and plan do not import one another);
- no module imports a private name (``_x``) from a module of another package (the package
  ``meshlm._torch_compat``, where every private torch API lives, is for all of meshlm);
- nothing inside meshlm imports the public facades (``meshlm``, ``meshlm.nn``), which exist
  for users: inside, each name is imported from where it is defined.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_imports import REPO, _owner, _walk, import_graph, modules

# The layers, bottom to top: the one place the order is written (docs/architecture.md draws it;
# test_architecture_doc_draws_these_layers holds the two together).  A package may import its
# own modules and any package of a lower layer; packages on one line are peers.
LAYERS: list[tuple[str, ...]] = [
    ("_torch_compat",),  # every private torch API, and the patches meshlm installs
    ("core",),  # the author API: axes, annotations, meshlm.nn's layers, scopes, ties, errors
    ("layout", "models"),  # layouts and meshes; the reference models (they see only core)
    ("runtime",),  # lowering, buckets, optimizer, offload, pipeline, compile
    ("interop", "data"),  # Hugging Face weights; training data
    ("train", "infer", "plan"),  # checkpoints and the step; generation and serving; the planners
    ("app",),  # the meshlm command: CLI, Hydra, config, launcher, sweeps
]
RANK = {pkg: i for i, line in enumerate(LAYERS) for pkg in line}
FACADES = {"meshlm", "meshlm.nn"}  # the public API, for users; never imported inside


def package_of(module: str) -> str | None:
    """The layer package a meshlm module belongs to (None for the facades)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and module not in FACADES else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        pkg = package_of(mod)
        if pkg is None:
            continue
        for dep in sorted(deps):
            if dep in FACADES:
                bad.append(f"{mod} imports the public facade {dep}; import the name from its home")
                continue
            other = package_of(dep)
            if other != pkg and RANK[other] >= RANK[pkg]:
                bad.append(f"{mod} ({pkg}, layer {RANK[pkg]}) imports {dep} ({other}, layer {RANK[other]})")
    return bad


def private_imports(mods: dict[str, Path]) -> list[str]:
    """``from a.b import _x`` where ``a.b``'s package is not the importer's package."""
    bad = []
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("meshlm"):
                continue
            for a in node.names:
                full = f"{node.module}.{a.name}"
                home = _owner(full, mods) or node.module
                there = home if mods.get(home, Path()).name == "__init__.py" else home.rpartition(".")[0]
                if full in mods:  # a module: its package is the module's parent
                    there = node.module
                if full == "meshlm._torch_compat":  # the one home of torch's private APIs, for every layer
                    continue
                if a.name.startswith("_") and not a.name.startswith("__") and there != here:
                    bad.append(f"{name} imports the private {full} from package {there}")
    return bad


def test_every_package_has_a_layer():
    tops = {p.name for p in (REPO / "meshlm").iterdir() if (p / "__init__.py").exists()}
    assert tops == set(RANK), (
        f"packages without a layer: {tops - set(RANK)}; layers without a package: {set(RANK) - tops}"
    )
    loose = sorted(p.name for p in (REPO / "meshlm").glob("*.py") if p.name not in ("__init__.py", "nn.py"))
    assert not loose, f"modules at meshlm's top level, outside every layer: {loose}"


def test_imports_flow_down_the_layers():
    bad = layer_violations(import_graph(modules(REPO)))
    assert not bad, "imports that go up or sideways between layers:\n" + "\n".join(bad)


def test_the_layer_check_sees_a_planted_upward_import():
    graph = import_graph(modules(REPO))
    graph["meshlm.runtime.lowering.params"] = graph["meshlm.runtime.lowering.params"] | {"meshlm.app.config"}
    graph["meshlm.train.step"] = graph["meshlm.train.step"] | {"meshlm.infer.cache"}
    graph["meshlm.core.axes"] = graph["meshlm.core.axes"] | {"meshlm"}
    assert layer_violations(graph) == [
        "meshlm.core.axes imports the public facade meshlm; import the name from its home",
        "meshlm.runtime.lowering.params (runtime, layer 3) imports meshlm.app.config (app, layer 6)",
        "meshlm.train.step (train, layer 5) imports meshlm.infer.cache (infer, layer 5)",
    ]


def test_no_private_name_crosses_a_package():
    bad = private_imports(modules(REPO))
    assert not bad, "private names imported from another package (make them public or move them):\n" + "\n".join(bad)


def test_the_private_check_sees_a_planted_import(tmp_path):
    (tmp_path / "meshlm" / "a").mkdir(parents=True)
    (tmp_path / "meshlm" / "b").mkdir()
    for f in ("meshlm/__init__.py", "meshlm/a/__init__.py", "meshlm/b/__init__.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "meshlm" / "a" / "x.py").write_text("_hidden = 1\nshown = 2\n")
    (tmp_path / "meshlm" / "a" / "y.py").write_text("from meshlm.a.x import _hidden\n")  # same package: fine
    (tmp_path / "meshlm" / "b" / "z.py").write_text("def f():\n    from meshlm.a.x import _hidden, shown\n")
    assert private_imports(modules(tmp_path)) == [
        "meshlm.b.z imports the private meshlm.a.x._hidden from package meshlm.a"
    ]


def test_architecture_doc_draws_these_layers():
    """docs/architecture.md has one section per layer package, in this order, bottom up."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    drawn = re.findall(r"^### `meshlm/(\w+)/`", doc, re.M)
    assert drawn == [pkg for line in LAYERS for pkg in line]
