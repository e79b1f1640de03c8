"""Every ``NOTE [title]`` pointer resolves.

A ``NOTE [title]`` block holds an invariant that spans files; code elsewhere points at it with
``NOTE [title] in path/to/file.py``.  When files move or split, pointers rot silently: this
test finds every pointer (in meshlm/, tests/, benchmarks/, docs/, README.md) and requires that
the file it names exists and defines that note, and that each note is defined once.

A note is defined in a Python file where its title starts a line (after ``#`` or ``#:`` in a
comment, or the quotes opening a docstring) and no ``in <file>`` follows it (docs only point
at notes; a test's docstring may open with the note it checks, so only the library's and the
test harness's definitions must be unique); a pointer is a ``NOTE [title]``
followed by ``in <file>``.  A pointer without a file (``NOTE [title]`` alone) must name a note
defined somewhere.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".md", ".yaml", ".sh", ".toml")

_TITLE = r"NOTE \[([^\]]+)\]"
# a definition: the note's title opens a line (docstring or comment), not followed by "in <file>"
_DEF = re.compile(
    r"^[ \t]*(?:#:?[ \t]*|[rRbB]?\"\"\"[ \t]*)?" + _TITLE + r"(?![ \t]*(?:\n[ \t]*#?[ \t]*)?in[ \t]+\S)", re.M
)
# a pointer: the title, then "in <path>" (possibly across a comment line break, in backquotes)
_PTR = re.compile(_TITLE + r"[ \t]*(?:\n[ \t]*#?[ \t]*)?(?:\(?)in[ \t]+(?:``|`)?([\w./-]+\.(?:py|md))")
_ANY = re.compile(_TITLE)


def norm(title: str) -> str:
    """A title as written across comment lines: ``#`` markers and runs of space collapsed."""
    return " ".join(title.replace("#:", " ").replace("#", " ").split())


def files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    skip = ("mutation/", "tests/unit/test_notes.py")  # mutation results quote old code; this file's examples
    return [root / f for f in out if f.endswith(SUFFIXES) and (root / f).is_file() and not f.startswith(skip)]


def definitions(paths: list[Path], root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in paths:
        if p.suffix != ".py":  # docs point at notes; code and tests define them
            continue
        for m in _DEF.finditer(p.read_text(errors="replace")):
            out.setdefault(norm(m.group(1)), []).append(str(p.relative_to(root)))
    return out


def resolves(path: str, defined_in: list[str]) -> bool:
    """``path`` names one of the files that define the note (a path from the repository root, or
    its tail, e.g. ``lowering/root.py`` or ``root.py`` for ``meshlm/runtime/lowering/root.py``)."""
    return any(d == path or d.endswith("/" + path) for d in defined_in)


def broken_pointers(root: Path) -> list[str]:
    paths = files(root)
    defs = definitions(paths, root)
    bad = []
    for title, where in sorted(defs.items()):
        # a test's docstring may open with the note it checks; the library defines each note once
        lib = sorted({w for w in where if not w.startswith("tests/") or w.startswith("tests/harness/")})
        if len(lib) > 1:
            bad.append(f"NOTE [{title}] is defined in {len(lib)} files: {lib}")
    for p in paths:
        text = p.read_text(errors="replace")
        rel = str(p.relative_to(root))
        pointed = set()
        for m in _PTR.finditer(text):
            title, path = norm(m.group(1)), m.group(2)
            pointed.add(m.start())
            if title not in defs:
                bad.append(f"{rel}: NOTE [{title}] in {path}: no such note is defined anywhere")
            elif not resolves(path, defs[title]):
                bad.append(f"{rel}: NOTE [{title}] in {path}: the note is in {sorted(set(defs[title]))}")
        for m in _ANY.finditer(text):
            if m.start() not in pointed and norm(m.group(1)) not in defs:
                bad.append(f"{rel}: NOTE [{norm(m.group(1))}]: no such note is defined anywhere")
    return bad


def test_every_note_pointer_resolves():
    bad = broken_pointers(REPO)
    assert not bad, "NOTE pointers that do not resolve (fix the path or the title):\n" + "\n".join(bad)


def test_the_check_sees_a_stale_pointer(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text('"""NOTE [the rule]\n    It holds.\n"""\n')
    (tmp_path / "pkg" / "b.py").write_text(
        "# NOTE [the\n# rule] in pkg/a.py\n"  # a title across comment lines: fine
        "x = 1  # NOTE [the rule] in a.py\n"  # the tail of the path: fine
        "y = 2  # NOTE [the rule] in pkg/b.py\n"  # stale: the note is in a.py
        "z = 3  # NOTE [no rule]\n"  # defined nowhere
    )
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    assert broken_pointers(tmp_path) == [
        "pkg/b.py: NOTE [the rule] in pkg/b.py: the note is in ['pkg/a.py']",
        "pkg/b.py: NOTE [no rule]: no such note is defined anywhere",
    ]
