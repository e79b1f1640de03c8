"""The counted-blocks check of tests/fake/test_plan_counted.py on every shipped layout the
counting applies to (NOTE [counted blocks] in meshlm/plan/repeats.py): the suite keeps one
layout of each kind; this sweeps them all, for our Llama with each activation checkpointing
and for the GPT-2 of tests/dist/test_nn_models.py:

    python benchmarks/plan_counted_sweep.py [--layouts ddp,hsdp] [--ac none,selective,full] [--gpt2]

Prints one line per case (its seconds, and "equal" or the first figure that differs) and
exits 1 if any counted plan differs from the same model measured whole.  One process, fake
tensors: a few seconds of CPU per case.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fake"), str(REPO / "tests" / "dist")]


def _case(build, layout: str, ac: str) -> str:
    import pytest
    import test_plan_counted as t

    with pytest.MonkeyPatch.context() as mp:
        counted, whole = t._both(build, layout, ac, mp)
    if counted == whole:
        return "equal"
    names = ("memory", "comm", "flops", "psi")
    return "differs: " + ", ".join(n for n, c, w in zip(names, counted, whole) if c != w)


def main(argv: list[str] | None = None) -> int:
    import test_plan_counted as t

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(t.ALL_LAYOUTS), help="comma-separated layouts")
    ap.add_argument("--ac", default="none,selective,full", help="activation checkpointing modes")
    ap.add_argument("--gpt2", action="store_true", help="the GPT-2 too (activation checkpointing none)")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(t.ALL_LAYOUTS))
    if unknown:
        ap.error(f"--layouts: {unknown} are not shipped layouts the counting applies to; choose from {t.ALL_LAYOUTS}")
    cases = [("llama", t._llama, layout, ac) for ac in args.ac.split(",") for layout in layouts]
    cases += [("gpt2", t._gpt2, layout, "none") for layout in layouts] if args.gpt2 else []
    bad = 0
    for model, build, layout, ac in cases:
        start = time.perf_counter()
        verdict = _case(build, layout, ac)
        bad += verdict != "equal"
        print(f"{model:6} {layout:11} ac={ac:9} {time.perf_counter() - start:6.1f} s  {verdict}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
