"""Lint and format: `ruff check`, with the rules in pyproject.toml ([tool.ruff]), and
`ruff format --check` pass on the whole repository. It runs here because CI runs exactly README's test command; ruff comes with
the `test` extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ruff(
    *args: str, stdin: str | None = None, command: tuple[str, ...] = ("check", "--output-format", "concise")
) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed; it comes with the test extra: pip install -e '.[test]'")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_check_passes():
    r = _ruff(".")
    assert r.returncode == 0, (
        "ruff check found problems (`ruff check --fix` fixes the import order; the rules are "
        f"in pyproject.toml [tool.ruff.lint]):\n{r.stdout}{r.stderr}"
    )


def test_ruff_rules_catch_what_they_should():
    """The configured rules are on: an unused import, imports out of order and an
    undefined name in a file under meshlm/ each fail."""
    bad = "import sys\nimport os\n\n\ndef f():\n    return undefined_name\n"
    r = _ruff("--stdin-filename", "meshlm/_lint_probe.py", "-", stdin=bad)
    assert r.returncode == 1, r.stdout + r.stderr
    for code in ("F401", "I001", "F821"):
        assert code in r.stdout, f"{code} is not reported: {r.stdout}"


def test_ruff_format_check_passes():
    r = _ruff("--check", ".", command=("format",))
    assert r.returncode == 0, f"ruff format would change these files (run `ruff format .`):\n{r.stdout}{r.stderr}"


def test_ruff_format_check_catches_unformatted_code():
    r = _ruff(
        "--check", "--stdin-filename", "meshlm/_format_probe.py", "-", stdin="x = {  'a':1 }\n", command=("format",)
    )
    assert r.returncode == 1, r.stdout + r.stderr
