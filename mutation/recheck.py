"""Check the unit pass's survivors again against named test files, without a new
``mutmut run`` (docs/mutation.md).

mutmut reruns, for each mutant, every test its stats say reaches the mutated function; for
a function that many tests reach (a parameter getter, the planner) that is minutes a
mutant, multi-process unit tests included.  After new tests are written for what survived,
this runs only those files against each survivor, in the mutated tree the unit pass made
(``mutants-unit/mutants``: ``MUTANT_UNDER_TEST`` selects the mutant, as mutmut does).  The
tests are copied into the tree first, so the tree's sources must be the repository's
(rerun ``MUTATION_TESTS=unit mutation/run.sh`` on the glob after changing them).

    python mutation/recheck.py --glob "meshlm.lowering.local_root*" tests/unit/test_local_root.py
    python mutation/recheck.py --unchecked --glob "meshlm.lowering.params*" tests/unit/test_params.py
    python mutation/recheck.py --survivors /tmp/first.json --glob "meshlm.lowering.blocks*" tests/dist/test_x.py

A mutant is killed when the tests fail with it.  Results (mutant -> "killed" or
"survived") go to ``mutation/results/recheck.json``, merged with earlier runs.
"""

from __future__ import annotations

import argparse
import fnmatch
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
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *a.tests]
    if subprocess.run(cmd, cwd=tree, env=dict(os.environ, MUTANT_UNDER_TEST=""), capture_output=True).returncode:
        raise SystemExit("mutation/recheck.py: the tests fail without a mutant (is the tree's source stale?)")
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for i, m in enumerate(todo, 1):
        r = subprocess.run(cmd, cwd=tree, env=dict(os.environ, MUTANT_UNDER_TEST=m), capture_output=True, timeout=600)
        results[m] = "survived" if r.returncode == 0 else "killed"
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"[{i}/{len(todo)}] {results[m]:8} {m}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
