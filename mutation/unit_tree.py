"""Make ``mutants-unit/``: a copy of the working tree whose ``[tool.mutmut]`` selects
``tests/unit`` only, for ``MUTATION_TESTS=unit mutation/run.sh`` (docs/mutation.md).

A mutant there runs only the single-process unit tests that reach it (seconds each), so
what survives is what the unit tests cannot see: a multi-process test may still kill it
(the full configuration's run says).  mutmut's own state lives in ``mutants-unit/mutants/``
and is kept between runs; the copy's sources are refreshed each time (files gone from the
working tree are removed from it).  Both directories are git-ignored.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "mutants-unit"


def main() -> None:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    files = {f for f in listed if f and (ROOT / f).is_file()}
    for old in DEST.rglob("*"):
        rel = old.relative_to(DEST).as_posix()
        if old.is_file() and not rel.startswith("mutants/") and rel not in files and "__pycache__" not in rel:
            old.unlink()
    for f in sorted(files):
        dst = DEST / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists() or dst.read_bytes() != (ROOT / f).read_bytes():
            shutil.copyfile(ROOT / f, dst)
    py = DEST / "pyproject.toml"
    text, n = re.subn(
        r"pytest_add_cli_args_test_selection = \[[^\]]*\]",
        'pytest_add_cli_args_test_selection = ["tests/unit"]',
        py.read_text(),
    )
    if n != 1:
        raise SystemExit("mutation/unit_tree.py: no pytest_add_cli_args_test_selection in pyproject.toml")
    py.write_text(text)


if __name__ == "__main__":
    main()
