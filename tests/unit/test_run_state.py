"""Where meshlm's state lives (NOTE [run state] in meshlm/core/state.py, NOTE [process-wide
tables] in meshlm/runtime/state.py).

- The inventory is complete: every module-level list, dict, set, context variable, weak
  container, lru_cache and ``global`` statement under meshlm/ is declared in
  ``meshlm.runtime.state`` (``INVENTORY`` or ``READ_ONLY``), every declared name exists,
  and no code writes a table declared read-only; each check is shown to catch a planted
  violation.
- The run state: ``scope`` sets fields and restores them (also on an error), ``counting``
  counts up and down, ``swap``/``restore`` pair up, unknown fields are refused, and the
  state is the process's (a scope set on one thread is seen on another).
- A sharded model that is deleted and collected leaves nothing of itself in the
  process-wide tables, and an equal model later takes the same indices again.
"""

from __future__ import annotations

import ast
import gc
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Placement

import meshlm
from harness.simworld import fake_mesh, patch_replicas
from meshlm.core import state
from meshlm.core.state import RUN, counting, scope
from meshlm.runtime import bucket
from meshlm.runtime.lowering import atuse, blocks, shard_state
from meshlm.runtime.state import INVENTORY, READ_ONLY

REPO = Path(__file__).resolve().parents[2]

# What makes a module-level value mutable: a literal or comprehension of a container, or a
# call of one of these (by the last part of its name).
_CONTAINERS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
_MAKERS = {
    "dict",
    "list",
    "set",
    "fromkeys",
    "sorted",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "bytearray",
    "ContextVar",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "local",
}
_CACHES = {"lru_cache", "cache"}
# Calls that change a container in place.
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "add",
    "discard",
    "remove",
    "sort",
    "reverse",
    "set",
    "reset",
}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _module_statements(body):
    """Statements at module level, inside module-level if / try / with / for blocks too."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _module_statements(inner)


def mutable_objects(root: Path) -> dict[str, int]:
    """``"path:name"`` -> line of every module-level mutable object under ``root``/meshlm."""
    found: dict[str, int] = {}
    for path in sorted((root / "meshlm").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        for node in _module_statements(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(_name(d.func if isinstance(d, ast.Call) else d) in _CACHES for d in node.decorator_list):
                    found[f"{rel}:{node.name}"] = node.lineno
                continue
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            mutable = isinstance(value, _CONTAINERS) or (isinstance(value, ast.Call) and _name(value.func) in _MAKERS)
            if not mutable:
                continue
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and n.id != "__all__":
                        found[f"{rel}:{n.id}"] = node.lineno
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for n in node.names:
                    found.setdefault(f"{rel}:{n}", node.lineno)
    return found


def declared() -> set[str]:
    out = set(INVENTORY)
    for path, names in READ_ONLY.items():
        out.update(f"{path}:{n}" for n in names.split())
    return out


def undeclared(root: Path) -> list[str]:
    known = declared()
    return [
        f"{key.split(':')[0]}:{line}: module-level {key.split(':')[1]} is not in meshlm/runtime/state.py: declare it "
        "in INVENTORY (kind, why it is module-level, what bounds it) or READ_ONLY, or move it onto an object the "
        "sharded model owns or into the run state (meshlm/core/state.py)"
        for key, line in sorted(mutable_objects(root).items())
        if key not in known
    ]


def _bound_names(path: Path) -> set[str]:
    names = set()
    for node in _module_statements(ast.parse(path.read_text()).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def stale(root: Path) -> list[str]:
    """Declared names that no module binds any more."""
    out = []
    for key in sorted(declared()):
        path, name = key.split(":")
        if not (root / path).exists() or name not in _bound_names(root / path):
            out.append(f"{key}: declared in meshlm/runtime/state.py but not bound there; remove the entry")
    return out


def _written(node: ast.AST, names: set[str]) -> tuple[str, bool] | None:
    """(name, through an attribute) of the table in ``names`` that ``node`` writes, or None."""
    if isinstance(node, ast.Global):
        hit = next((n for n in node.names if n in names), None)
        return None if hit is None else (hit, False)
    targets: list = []
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
    elif isinstance(node, ast.AugAssign):
        targets = [node.target.value if isinstance(node.target, ast.Subscript) else node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        targets = [node.func.value]
    for t in targets:
        if _name(t) in names:
            return _name(t), isinstance(t, ast.Attribute)
    return None


def writes_to_read_only(root: Path) -> list[str]:
    """Writes under meshlm/ to a table declared read-only, after import: in a function of its
    own module, or anywhere through an attribute (``module.NAME``) or an imported name (a
    table of another module with the same name counts too, which errs on the safe side)."""
    owners: dict[str, set[str]] = {}
    for path, ns in READ_ONLY.items():
        for n in ns.split():
            owners.setdefault(n, set()).add(path)
    bad = []
    for path in sorted((root / "meshlm").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        own = _bound_names(path)
        at_import = {
            id(n)
            for stmt in tree.body
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            hit = _written(node, set(owners))
            if hit is None:
                continue
            name, through_attribute = hit
            if not through_attribute and name in own and rel not in owners[name]:
                continue  # a module-level object of this module's own that has the same name
            if not through_attribute and rel in owners[name] and id(node) in at_import:
                continue  # filled at import
            bad.append(f"{rel}:{node.lineno}: writes {name}, declared read-only in meshlm/runtime/state.py")
    return bad


# ----------------------------------------------------------------------------- the inventory


def test_every_module_level_mutable_object_is_declared():
    assert undeclared(REPO) == []


def test_every_declared_object_exists():
    assert stale(REPO) == []


def test_no_code_writes_a_read_only_table():
    assert writes_to_read_only(REPO) == []


def test_the_checks_catch_planted_violations(tmp_path):
    shutil.copytree(REPO / "meshlm", tmp_path / "meshlm")
    planted = tmp_path / "meshlm" / "runtime" / "bucket" / "spec.py"
    planted.write_text(
        planted.read_text()
        + "\n\n_SEEN: dict = {}\n"
        + "if True:\n    _LATER = []\n"
        + "\n\ndef _f():\n    global _COUNT\n    _COUNT = 1\n"
        + "\n\n@functools.lru_cache\ndef _g():\n    pass\n"
        + "\n\ndef _h():\n    SCHEDULES['x'] = 1\n    HARDWARE.update(x=1)\n"
    )
    (tmp_path / "meshlm" / "core" / "state.py").write_text(
        (REPO / "meshlm" / "core" / "state.py").read_text().replace("RUN = RunState()", "STATE = RunState()")
    )
    got = undeclared(tmp_path)
    assert [g.split(": ")[1] for g in got] == [
        "module-level _COUNT is not in meshlm/runtime/state.py",
        "module-level _LATER is not in meshlm/runtime/state.py",
        "module-level _SEEN is not in meshlm/runtime/state.py",
        "module-level _g is not in meshlm/runtime/state.py",
    ], got
    assert all(g.startswith("meshlm/runtime/bucket/spec.py:") for g in got)
    assert [s.split(":")[1] for s in stale(tmp_path)] == ["RUN"]
    assert [w.split(": ")[1] for w in writes_to_read_only(tmp_path)] == [
        "writes SCHEDULES, declared read-only in meshlm/runtime/state.py",
        "writes HARDWARE, declared read-only in meshlm/runtime/state.py",
    ]


# ----------------------------------------------------------------------------- the run state


def test_scope_sets_and_restores_also_on_an_error():
    assert RUN.changed() == {}
    h1, h2 = object(), object()
    with scope(handler=h1, rows=(1, 2)):
        assert (RUN.handler, RUN.rows) == (h1, (1, 2))
        with pytest.raises(RuntimeError, match="boom"):
            with scope(handler=h2):
                assert RUN.handler is h2 and RUN.rows == (1, 2)
                raise RuntimeError("boom")
        assert RUN.handler is h1
    assert RUN.changed() == {}


def test_swap_and_restore_pair_up():
    saved = state.swap(stage="run", on_use=print)
    assert RUN.changed() == {"stage": "run", "on_use": print}
    state.restore(saved)
    assert RUN.changed() == {}


def test_counting_counts_up_and_down():
    with counting("gathering"):
        with counting("gathering", 2):
            assert RUN.gathering == 3
        with counting("local_root"):
            assert (RUN.gathering, RUN.local_root) == (1, 1)
    assert RUN.changed() == {}


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError, match=r"no field 'handlr'; the fields are handler, rows"):
        scope(handlr=None)
    with pytest.raises(TypeError, match="'handler' is not a counter"):
        counting("handler")
    with pytest.raises(TypeError, match="no field 'x'"):
        state.swap(x=1)


def test_the_run_state_is_the_process_s():
    """NOTE [run state]: one object for every thread (what Dynamo can read), so a scope set
    here is what code on another thread (autograd's, a simulated rank's) sees."""
    seen = []
    with scope(handler="h"):
        t = threading.Thread(target=lambda: seen.append(RUN.handler))
        t.start()
        t.join()
    assert seen == ["h"]


def test_eager_under_fake_tensors_is_what_fake_eager_says():
    assert state.eager()
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not state.eager()
        with scope(fake_eager=True):
            assert state.eager()


# ----------------------------------------------------------------------------- a collected model


class _Layer(torch.nn.Module):
    param_axes = {"w": ("mlp", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(6, 4, device=device))

    def init_weights(self, gen):
        torch.nn.init.normal_(self.w, generator=gen)

    def forward(self, x):
        return x + torch.tanh(x @ self.w.T) @ self.w


_Block = meshlm.block(_Layer)


class _Net(torch.nn.Module):
    param_axes = {"head": ("vocab", "embed")}

    def __init__(self, device=None):
        super().__init__()
        self.l0, self.l1 = _Block(device), _Block(device)
        self.head = torch.nn.Parameter(torch.empty(5, 4, device=device))

    def init_weights(self, gen):
        torch.nn.init.normal_(self.head, generator=gen)

    def forward(self, x):
        return meshlm.reduce_batch((self.l1(self.l0(x)) @ self.head.T).square().mean(), "mean")


def _plain(value) -> bool:
    """Whether ``value`` is made of plain values only (nothing of a model)."""
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, blocks.BlockSpec):
        return all(_plain(getattr(value, f)) for f in value.__dataclass_fields__)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, Placement))


@pytest.fixture
def world(monkeypatch):
    mesh = fake_mesh({"fsdp": 2})
    patch_replicas(monkeypatch)
    yield mesh
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_collected_model_leaves_nothing_in_the_process_wide_tables(world):
    """After a model (one training step run) is deleted and collected, nothing keeps it or its
    ShardState alive, the bucket slots it registered are empty (no mesh of it held), every
    at-use entry and block spec is plain values, and the run state is at its defaults.  An
    equal model sharded afterwards takes the same bucket indices again (a compiled graph
    that holds one stays valid)."""
    gc.collect()  # the models of earlier tests, on equal meshes, let go of their buckets
    model = meshlm.shard(_Net(device="meta"), "fsdp", world, seed=0)
    model(torch.randn(3, 4)).backward()
    st = shard_state(model)
    keys = {m._meshlm_block.key for m in (model.l0, model.l1)}
    assert keys and all(bucket.BUCKETS[k].mesh is world for k in keys)
    gone = [weakref.ref(model), weakref.ref(st)]
    del model, st
    gc.collect()
    assert [r() for r in gone] == [None, None]
    assert all(bucket.BUCKETS[k] is None for k in keys)
    assert not any(b is not None and b.mesh is world for b in bucket.BUCKETS)
    assert all(_plain(v) for v in atuse._AT_USE) and all(_plain(s) for s in blocks._SPECS)
    assert RUN.changed() == {}
    again = meshlm.shard(_Net(device="meta"), "fsdp", world, seed=0)
    assert {m._meshlm_block.key for m in (again.l0, again.l1)} == keys
    assert all(bucket.BUCKETS[k].mesh is world for k in keys)


def test_two_models_hold_their_buckets_apart(world):
    """A bucket two equal models share stays while either lives."""
    gc.collect()
    a = meshlm.shard(_Net(device="meta"), "fsdp", world, seed=0)
    b = meshlm.shard(_Net(device="meta"), "fsdp", world, seed=1)
    key = a.l0._meshlm_block.key
    assert b.l0._meshlm_block.key == key
    del a
    gc.collect()
    assert bucket.BUCKETS[key] is not None
    del b
    gc.collect()
    assert bucket.BUCKETS[key] is None
