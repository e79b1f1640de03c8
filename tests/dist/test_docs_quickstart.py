"""The quickstart output that README.md and docs/train.md quote is what `meshlm train` prints.

The quote comes from a real 100-step run (numbers differ run to run and machine to
machine); this runs the same command for a few steps and holds the quoted first line and
final line to the program's, with every number and path made a placeholder: a change to
what the program prints that the docs do not follow fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_train_cli import meshlm

REPO = Path(__file__).resolve().parents[2]
QUOTING = [REPO / "README.md", REPO / "docs" / "train.md"]
# numbers (1,234 / 3.1 / 5.55 / 2026-12-01 / 03-44-49 / 100 / 4,302) and paths
_NUMBER = re.compile(r"\d[\d,.\-]*\d|\d")
_PATH = re.compile(r"/\S+")


def shape(line: str) -> str:
    return _NUMBER.sub("N", _PATH.sub("PATH", line.strip()))


def quoted(doc: Path) -> dict[str, str]:
    """The first `meshlm train:` line and the `done:` line of the doc's quickstart quote."""
    text = doc.read_text()
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M):
        if lang not in ("", "text"):  # output, not code
            continue
        lines = block.splitlines()
        first = [x for x in lines if x.startswith("meshlm train: llama_small")]
        done = [x for x in lines if x.startswith("done: ")]
        if first and done:
            return {"first": first[0], "done": done[0]}
    raise AssertionError(f"{doc}: no quoted quickstart output (a block with `meshlm train:` and `done:`)")


def test_shape_tells_numbers_from_words():
    assert shape("done: 100 steps in 52s; 2,193 tokens/s; outputs in /tmp/a/b") == shape(
        "done: 4 steps in 3s; 12 tokens/s; outputs in /x"
    )
    assert shape("done: 100 steps in 52s") != shape("done: 100 steps in 52s; peak mem/rank 430MiB")


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, str]:
    """The quickstart command (`meshlm train`, its defaults), run for 4 steps instead of 100."""
    run = tmp_path_factory.mktemp("quickstart") / "run"
    r = meshlm("train", "train.steps=4", f"hydra.run.dir={run}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    return {
        "first": next(x for x in lines if x.startswith("meshlm train: ")),
        "done": next(x for x in lines if x.startswith("done: ")),
    }


@pytest.mark.parametrize("doc", QUOTING, ids=lambda p: p.name)
def test_quoted_quickstart_is_what_meshlm_train_prints(doc, printed):
    want, got = quoted(doc), printed
    for k in ("first", "done"):
        assert shape(got[k]) == shape(want[k]), (
            f"{doc.name} quotes a `{k}` line that meshlm train no longer prints: rerun the quickstart and "
            f"quote it.\nquoted:  {want[k]}\nprinted: {got[k]}"
        )
