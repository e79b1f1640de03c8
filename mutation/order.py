"""A pytest plugin for mutation runs only (docs/mutation.md): cheap tests first.

mutmut runs the tests that reach a mutated function with ``-x``, in the order of a set, so
a mutant that a unit test kills in a second can wait minutes behind multi-process tests
(and a module's tests, split up, start its process pool more than once). This sorts them:
``tests/unit``, then ``tests/fake``, then ``tests/dist`` (the cheaper modules first), each
module's tests together and in file order. mutmut loads it through ``pytest_add_cli_args``
in pyproject's ``[tool.mutmut]``; an ordinary ``pytest`` run never does.
"""

from __future__ import annotations

TIERS = ("tests/unit/", "tests/fake/", "tests/dist/")
# Multi-process modules by cost (process pools started, then run time), cheapest first.
DIST_MODULES = (
    "tests/dist/test_budget.py",
    "tests/dist/test_inputs_outputs.py",
    "tests/dist/test_mixed_precision.py",
    "tests/dist/test_parity.py",
)


def _key(item) -> tuple:
    path = item.nodeid.split("::")[0].removeprefix("mutants/")
    tier = next((i for i, t in enumerate(TIERS) if path.startswith(t)), len(TIERS))
    module = DIST_MODULES.index(path) if path in DIST_MODULES else len(DIST_MODULES)
    return tier, module, path, item.location[1] or 0


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=_key)  # stable: parametrized cases of one test keep their order
