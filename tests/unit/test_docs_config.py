"""The docs and the config agree: every ``meshlm train`` / ``meshlm plan`` command in a code
block of README.md or docs/*.md, and every inline ``key=value`` override, composes into a
valid RunConfig; every config key the docs name in backticks exists."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from meshlm.app.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = "model|optim|layout|mesh|train|data|checkpoint|plan|pipeline|offload|logger"
OVERRIDE = re.compile(rf"^(?:{SECTIONS})(?:\.\w+)*=\S+$")


def _commands() -> list[tuple[str, list[str]]]:
    """(where, overrides) for each documented command line, continuations joined."""
    out = []
    for doc in DOCS:
        lines = doc.read_text().split("\n")
        fence = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                fence = not fence
            elif fence and re.match(r"^\s*(\$ )?meshlm (train|plan)\b(?!:)", line):
                where = f"{doc.name}:{i + 1}"
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i]
                words = shlex.split(line.split(" #")[0].split("|")[0])
                sweep = "-m" in words
                over = [w.split(",")[0] if sweep else w for w in words if OVERRIDE.match(w)]
                out.append((where, over))
            i += 1
    return out


def _inline() -> list[tuple[str, str]]:
    return [
        (doc.name, m) for doc in DOCS for m in re.findall(r"`([^`\s]+=[^`\s]+)`", doc.read_text()) if OVERRIDE.match(m)
    ]


COMMANDS = _commands()


@pytest.fixture(autouse=True)
def _usermodel_on_path(monkeypatch):
    """The docs' own-model example names tests/usermodel/mymodels."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "usermodel"))


def test_docs_hold_commands():
    assert len(COMMANDS) > 10 and any("checkpoint.resume=auto" in o for _, o in COMMANDS)


@pytest.mark.parametrize("where,overrides", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_composes(where, overrides):
    load_config(overrides)


def test_documented_overrides_compose():
    found = sorted(set(_inline()))
    assert len(found) > 5
    for where, o in found:
        needs = ["checkpoint.dir=/x"] if o == "checkpoint.resume=auto" else []
        try:
            load_config(needs + [o])
        except Exception as e:  # noqa: BLE001 - report where the docs say it
            raise AssertionError(f"{where}: `{o}`: {e}") from None


def test_documented_keys_exist():
    keys = {
        f"{s.name}.{f.name}" for s in dataclasses.fields(RunConfig) for f in dataclasses.fields(s.default_factory())
    }
    named = {
        (doc.name, m)
        for doc in DOCS
        for m in re.findall(r"`((?:mesh|train|data|checkpoint|plan)\.[a-z_0-9]+)[`=]", doc.read_text())
    }
    assert len(named) > 20
    wrong = sorted(f"{where}: {k}" for where, k in named if k not in keys)
    assert not wrong, f"the docs name config keys that do not exist: {wrong}"
