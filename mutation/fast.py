"""Check mutants against the multi-process battery (mutation/battery.py) in long-lived
process pools (docs/mutation.md, "The multi-process pass").

mutmut runs one pytest process per mutant, and each multi-process test module starts its
process pool again there: 40 to 90 s a mutant on 2 cores, most of it start-up.  mutmut's
trampolines read ``MUTANT_UNDER_TEST`` at every call, so one pool of workers can check
mutant after mutant: each job sets the variable in the workers, runs a check, and clears
it.  A check that fails (or hangs past ``--job-timeout``) kills the mutant; the pools are
then restarted, so that nothing a mutant left behind (a process-wide table, a half-done
collective) reaches the next one.  Survivors are checked again at the end in fresh pools
(``--recheck``), so that none survives on what an earlier mutant left.

    python mutation/fast.py                          # the unit pass's survivors and untested
    python mutation/fast.py --glob "meshlm.runtime.optim.sharded*"   # of one module
    python mutation/fast.py --report                 # the table, from the results file

It reads the mutants and the unit pass's results from a mutmut tree (``--tree``, default
``mutants-unit/mutants``: ``MUTATION_TESTS=unit mutation/run.sh`` made it) and writes its
own results to ``mutation/results/fast.json`` in the repository (one entry per mutant:
status, the check that killed it, seconds), resuming where a previous run stopped.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}


def unit_results(tree: Path) -> dict[str, str]:
    """mutant -> the unit pass's status, from mutmut's .meta files under ``tree``."""
    out = {}
    for meta in sorted((tree / "meshlm").rglob("*.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = STATUS.get(code, "timeout" if code in (24, -24, 36, 152, 255) else f"exit {code}")
    return out


class Pools:
    def __init__(self, job_timeout: float):
        self.job_timeout, self.pools = job_timeout, {}

    def get(self, n: int):
        from harness.dist import DistPool

        if n not in self.pools:
            self.pools[n] = DistPool(n, timeout_s=60, job_timeout_s=self.job_timeout)
        return self.pools[n]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools = {}


def check(pools: Pools, mutant: str, battery) -> tuple[str, str | None]:
    """("killed", the check) or ("survived", None)."""
    from battery import run_with

    from harness.dist import WorkerError

    for name, n, fn, args, kw in battery:
        try:
            pools.get(n).run(run_with, mutant, fn, args, kw)
        except (WorkerError, RuntimeError) as e:  # RuntimeError: a worker died (a crash counts as a kill)
            pools.close()
            return "killed", f"{name}: {str(e).splitlines()[1][:200] if len(str(e).splitlines()) > 1 else e}"
    return "survived", None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(ROOT / "mutants-unit" / "mutants"))
    ap.add_argument("--glob", default="*")
    ap.add_argument("--status", default="survived,no tests", help="the unit pass's statuses to check")
    ap.add_argument("--out", default=str(ROOT / "mutation" / "results" / "fast.json"))
    ap.add_argument("--job-timeout", type=float, default=240.0)
    ap.add_argument("--limit", type=int, default=0, help="check at most this many mutants (0: all)")
    ap.add_argument(
        "--checks", default="", help="only the battery's checks whose name contains one of these (comma-separated)"
    )
    ap.add_argument("--recheck", action="store_true", help="check the survivors again, each in fresh pools")
    ap.add_argument("--report", action="store_true", help="print the counts per function and stop")
    a = ap.parse_args(argv)
    tree = Path(a.tree).resolve()
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    units = unit_results(tree)
    if a.report:
        report(units, results)
        return 0
    # The battery is not mutated: take the repository's, not the copy mutmut made when the
    # tree was built (a battery edited since would otherwise go unused, silently).
    shutil.copyfile(ROOT / "mutation" / "battery.py", tree / "mutation" / "battery.py")
    os.chdir(tree)
    sys.path[:0] = [str(tree), str(tree / "mutation"), str(tree / "tests")]
    os.environ["MUTANT_UNDER_TEST"] = ""
    import battery as bat

    if a.checks:  # a module's own checks first (a function only some reach is checked faster)
        words = a.checks.split(",")
        bat.BATTERY[:] = [c for c in bat.BATTERY if any(w in c[0] for w in words)]
    want = set(a.status.split(","))
    todo = [m for m, s in units.items() if s in want and fnmatch.fnmatch(m, a.glob)]
    if a.recheck:
        todo = [m for m in todo if results.get(m, {}).get("status") == "survived"]
    else:
        todo = [m for m in todo if m not in results]
    if a.limit:
        todo = todo[: a.limit]
    pools = Pools(a.job_timeout)
    try:
        if not a.recheck:  # the battery passes unmutated, and fails with every trampoline raising
            if check(pools, "", bat.BATTERY) != ("survived", None):
                raise SystemExit("mutation/fast.py: the battery fails without a mutant")
            if check(pools, "fail", bat.BATTERY[:1])[0] != "killed":
                raise SystemExit("mutation/fast.py: the workers do not run the mutated tree")
        for i, m in enumerate(todo, 1):
            t0 = time.perf_counter()
            status, by = check(pools, m, bat.BATTERY)
            if a.recheck:
                pools.close()
            results[m] = {"status": status, "by": by, "s": round(time.perf_counter() - t0, 1), "recheck": a.recheck}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            print(f"[{i}/{len(todo)}] {status:8} {m}  {by or ''}", flush=True)
    finally:
        pools.close()
    return 0


def function_of(mutant: str) -> str:
    return mutant.rsplit("__mutmut_", 1)[0].replace("xǁ", "").replace("ǁ", ".")


def report(units: dict[str, str], results: dict) -> None:
    """Per function: mutants, killed by the unit pass, killed here, survived, not checked."""
    rows: dict[str, Counter] = {}
    for m, s in units.items():
        c = rows.setdefault(function_of(m), Counter())
        c["mutants"] += 1
        if s == "killed":
            c["unit"] += 1
        elif m in results:
            c[results[m]["status"]] += 1
        else:
            c["not checked" if s in ("survived", "no tests") else s] += 1
    cols = ("mutants", "unit", "killed", "survived", "not checked")
    print("| function | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    total: Counter = Counter()
    for f in sorted(rows):
        total.update(rows[f])
        print(f"| `{f}` | " + " | ".join(str(rows[f][c]) for c in cols) + " |")
    print("| **total** | " + " | ".join(str(total[c]) for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
