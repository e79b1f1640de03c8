"""Check the unit pass's survivors again against named test files, without a new
``mutmut run`` (docs/mutation.md).

mutmut reruns, for each mutant, every test its stats say reaches the mutated function; for
a function that many tests reach (a parameter getter, the planner) that is minutes a
mutant, multi-process unit tests included.  After new tests are written for what survived,
this runs only those files against each survivor, in the mutated tree the unit pass made
(``mutants-unit/mutants``: ``MUTANT_UNDER_TEST`` selects the mutant, as mutmut does).  The
tests are copied into the tree first, so the tree's sources must be the repository's
(rerun ``MUTATION_TESTS=unit mutation/run.sh`` on the glob after changing them).

    python mutation/recheck.py --glob "meshlm.runtime.lowering.local_root*" tests/unit/test_local_root.py
    python mutation/recheck.py --unchecked --glob "meshlm.runtime.lowering.params*" tests/unit/test_params.py
    python mutation/recheck.py --survivors /tmp/first.json --glob "meshlm.runtime.lowering.blocks*" tests/dist/test_x.py

A mutant is killed when the tests fail with it.  Results (mutant -> "killed" or
"survived") go to ``mutation/results/recheck.json``, merged with earlier runs.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "mutation"))

from fast import unit_results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="+", help="test files, relative to the repository")
    ap.add_argument("--glob", default="*")
    ap.add_argument(
        "--unchecked",
        action="store_true",
        help="also the mutants the unit pass has not checked yet (a function many tests reach, whose unit pass "
        "would take hours); one killed here is killed, one that survives here is only not killed by these files",
    )
    ap.add_argument(
        "--survivors",
        metavar="JSON",
        help="only the mutants an earlier recheck left surviving (its --out file), for a second stage: "
        "new tests, or the multi-process files that reach them",
    )
    ap.add_argument("-k", dest="keyword", help="pytest's -k: a first stage without the slowest tests, say")
    ap.add_argument("--resume", action="store_true", help="skip the mutants --out already has a result for")
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="a new pytest process for each mutant, instead of a fork of one that has imported torch and meshlm "
        "(about 8 s less a mutant)",
    )
    ap.add_argument("--tree", default=str(ROOT / "mutants-unit" / "mutants"))
    ap.add_argument("--out", default=str(ROOT / "mutation" / "results" / "recheck.json"))
    a = ap.parse_args(argv)
    tree = Path(a.tree).resolve()
    for t in a.tests:
        shutil.copyfile(ROOT / t, tree / t)
    wanted = ("survived", "no tests") + (("not checked",) if a.unchecked else ())
    if a.survivors:
        earlier = json.loads(Path(a.survivors).read_text())
        todo = sorted(m for m, s in earlier.items() if s == "survived" and fnmatch.fnmatch(m, a.glob))
    else:
        todo = [m for m, s in unit_results(tree).items() if s in wanted and fnmatch.fnmatch(m, a.glob)]
    args = ["-x", "-q", "-p", "no:cacheprovider", *(["-k", a.keyword] if a.keyword else []), *a.tests]
    run = _spawner(args, tree) if a.spawn else _forker(args, tree)
    if run(""):
        raise SystemExit("mutation/recheck.py: the tests fail without a mutant (is the tree's source stale?)")
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if a.resume:
        todo = [m for m in todo if m not in results]
    for i, m in enumerate(todo, 1):
        results[m] = "survived" if run(m) == 0 else "killed"
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"[{i}/{len(todo)}] {results[m]:8} {m}", flush=True)
    return 0


TIMEOUT_S = 600


def _spawner(args: list[str], tree: Path):
    """Each mutant's tests in a new ``python -m pytest`` in the tree: its exit code."""
    cmd = [sys.executable, "-m", "pytest", *args]

    def run(mutant: str) -> int:
        env = dict(os.environ, MUTANT_UNDER_TEST=mutant)
        try:
            return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            return -1

    return run


def _imports(path: Path) -> list[str]:
    """The absolute module names a test file imports at its top level."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def _forker(args: list[str], tree: Path):
    """Each mutant's tests in a fork of this process, which has imported the tree's ``meshlm``
    (and torch) once; a child runs no tree code before its mutant is set, and ends with
    ``os._exit``, so no mutant sees what another left.  As mutmut's own runner does; no torch
    op runs here before a fork (an OpenMP pool forked while in use can hang the child)."""
    os.chdir(tree)
    sys.path.insert(0, str(tree))
    import pytest

    import harness  # noqa: F401
    import meshlm  # noqa: F401  the tree's: it is first on the path

    if not str(Path(meshlm.__file__).resolve()).startswith(str(tree)):
        raise SystemExit(f"mutation/recheck.py: meshlm imported from {meshlm.__file__}, not the tree {tree}")
    for t in args:  # what the test files import, imported once here (their collection then costs little)
        if t.endswith(".py") and (tree / t).is_file():
            for name in _imports(tree / t):
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001  a test's own optional import: it finds out itself
                    pass

    def run(mutant: str) -> int:
        pid = os.fork()
        if pid == 0:
            import signal

            signal.alarm(TIMEOUT_S)  # a hang is a kill, as mutmut counts a timeout
            os.environ["MUTANT_UNDER_TEST"] = mutant
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = 1
            try:
                code = int(pytest.main(args))
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    return run


if __name__ == "__main__":
    sys.exit(main())
