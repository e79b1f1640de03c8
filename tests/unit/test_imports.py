"""meshlm's modules import one another without cycles, counting every import, including the
ones inside functions (a lazy import hides a cycle from Python, not from the reader): the
dependency direction each package writes at its top holds.  Read from the source (the AST);
imports under ``if TYPE_CHECKING:`` would count too, so there are none.  Only a script's
``if __name__ == "__main__":`` block is left out: it runs when the module is the program
(``python -m meshlm.app.train``), never when another module imports it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root / "meshlm"``."""
    out = {}
    for path in sorted((root / "meshlm").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and getattr(test.comparators[0], "value", None) == "__main__"
    )


def _walk(tree: ast.AST):
    """``ast.walk`` without what a module's ``if __name__ == "__main__":`` block holds."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_main_block(c))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the meshlm modules it imports anywhere in its source.  ``from pkg import x``
    counts as importing ``pkg.x`` when that is a module, else ``pkg``."""
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in _walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges |= {t for t in (_owner(x, mods) for x in targets if x.split(".")[0] == "meshlm") if t}
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions(tmp_path):
    (tmp_path / "meshlm").mkdir()
    (tmp_path / "meshlm" / "__init__.py").write_text("")
    (tmp_path / "meshlm" / "cli.py").write_text("def main():\n    from meshlm.train import run\n")
    (tmp_path / "meshlm" / "train.py").write_text("def main():\n    from meshlm import cli\n")
    graph = import_graph(modules(tmp_path))
    assert graph["meshlm.cli"] == {"meshlm.train"} and graph["meshlm.train"] == {"meshlm.cli"}
    assert cycles(graph) == [["meshlm.cli", "meshlm.train"]]
    # a script's main block is not an import of the module
    (tmp_path / "meshlm" / "train.py").write_text('if __name__ == "__main__":\n    from meshlm import cli\n')
    assert cycles(import_graph(modules(tmp_path))) == []


def test_meshlm_has_no_import_cycles():
    found = cycles(import_graph(modules(REPO)))
    assert not found, (
        "import cycles among meshlm's modules (each list imports itself around; move what both "
        f"sides need below both): {found}"
    )


def stated_order(package: Path) -> list[str]:
    """The files a package's docstring lists (``    name.py   what it holds``), top to bottom:
    its dependency direction, each file importing only files below it."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    out = []
    for line in doc.splitlines():
        words = line.split()
        if line.startswith("    ") and words and words[0].endswith(".py"):
            out.append(words[0][:-3])
    return out


def upward_imports(package: Path, graph: dict[str, set[str]]) -> list[str]:
    """Imports between a package's files that go up its stated order (or name a file the
    docstring does not list)."""
    name = ".".join(package.relative_to(REPO).parts)
    order = stated_order(package)
    files = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    bad = [f"{name}: {sorted(files - set(order))} not in the docstring's list"] if files - set(order) else []
    for i, mod in enumerate(order):
        for dep in graph.get(f"{name}.{mod}", ()):
            short = dep.removeprefix(f"{name}.")
            if dep.startswith(f"{name}.") and short in order and order.index(short) <= i:
                bad.append(f"{name}.{mod} imports {short}, listed above it")
    return bad


def test_packages_import_downward_only():
    graph = import_graph(modules(REPO))
    for pkg in ("runtime/lowering", "runtime/bucket", "_torch_compat"):
        assert stated_order(REPO / "meshlm" / pkg), pkg
        assert not upward_imports(REPO / "meshlm" / pkg, graph)
    # the check itself sees an upward import
    graph["meshlm.runtime.lowering.params"] = graph["meshlm.runtime.lowering.params"] | {
        "meshlm.runtime.lowering.shard"
    }
    assert upward_imports(REPO / "meshlm" / "runtime" / "lowering", graph) == [
        "meshlm.runtime.lowering.params imports shard, listed above it"
    ]
