"""docs/plan.md quotes what `meshlm plan` prints: docs/plan/run.sh writes each command and its
output to docs/plan/<name>.txt, the page quotes every such file verbatim, and the commands
planned by formula (fast) print today exactly what the files hold."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
OUTPUTS = sorted((DOCS / "plan").glob("*.txt"))


def test_every_regenerated_output_is_quoted_verbatim():
    page = (DOCS / "plan.md").read_text()
    run = (DOCS / "plan" / "run.sh").read_text()
    assert OUTPUTS and all(f"run {f.stem} " in run for f in OUTPUTS)
    for f in OUTPUTS:
        assert f"```\n{f.read_text().rstrip()}\n```" in page, f"docs/plan.md does not quote {f.name} as it is"


def test_readme_quotes_the_start_of_a_regenerated_output():
    readme = (DOCS.parent / "README.md").read_text()
    block = readme.split("abridged):\n\n```\n", 1)[1].split("\n```", 1)[0]
    assert any(f.read_text().startswith(block + "\n") for f in OUTPUTS), block


@pytest.mark.parametrize("name", [f.stem for f in OUTPUTS if "plan.method=formula" in f.read_text().splitlines()[0]])
def test_formula_outputs_are_what_the_command_prints(name, capsys, monkeypatch):
    from meshlm.app.cli import main

    monkeypatch.chdir(DOCS.parent)
    head, *expected = (DOCS / "plan" / f"{name}.txt").read_text().rstrip("\n").splitlines()
    args = shlex.split(head.removeprefix("$ meshlm plan "))
    args = [
        a if not a.startswith("plan.png=") else "plan.png=" + str(Path(a[9:]).with_suffix(".test.png")) for a in args
    ]
    try:
        main(["plan", *args])
    finally:
        for a in args:
            if a.startswith("plan.png="):
                Path(a[9:]).unlink(missing_ok=True)
    cap = capsys.readouterr()
    got = (cap.out + cap.err).rstrip("\n").replace(".test.png", ".png").splitlines()
    assert got == expected
