"""docs/plan.md quotes what `meshlm plan` prints: docs/plan/run.sh writes each command and its
output to docs/plan/<name>.txt, the page quotes every such file verbatim, and the commands
planned by formula (fast) print today exactly what the files hold."""

from __future__ import annotations

import re
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


def test_every_quote_of_a_regenerated_command_is_its_output():
    """A `$ meshlm plan` transcript anywhere in README.md or docs/ of a command docs/plan/run.sh
    runs is that command's output, all of it or its start (abridged)."""
    pages = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    heads = {f.read_text().split("\n", 1)[0]: f for f in OUTPUTS}
    quotes = [
        (page.name, block)
        for page in pages
        for block in re.findall(r"```[a-z]*\n(\$ meshlm plan .*?)\n```", page.read_text(), re.S)
        if block.split("\n", 1)[0] in heads
    ]
    assert len(quotes) >= len(OUTPUTS)
    for where, block in quotes:
        f = heads[block.split("\n", 1)[0]]
        assert f.read_text().startswith(block + "\n"), f"{where} quotes {f.name}'s command and not its output"


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
