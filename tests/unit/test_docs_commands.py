"""Every shell command in README.md and docs/ is either run by a test or says why it is not.

A shell command block is a fenced block labelled ``bash``, ``sh``, ``shell`` or ``console``,
or an unlabelled one with a line that starts with a command (``meshlm``, ``python``, ``pip``,
``torchrun``, ...). Each command in it must be in ``RUN_BY``, which names the test that runs
it, or the block must be marked on the line before its fence with a visible reason::

    <!-- not run: needs a GPU -->

The cheap commands (``meshlm layout show``, ``meshlm layout list``, ``meshlm plan generate``)
are run here, in this process, and where the page quotes what they print (a ``console`` block:
``$ command`` then its output) the output must be what they print today."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = "tests/unit/test_docs_commands.py"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
# a line that runs something: optional `$ ` prompt and VAR=value assignments, then a command word
_COMMAND = re.compile(
    r"^(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S* )*"
    r"(?:meshlm|python3?|pip|torchrun|sbatch|srun|curl|bash|mutmut|pytest|ruff|mkdocs|mutation/\S+|benchmarks/\S+)(?:\s|$)"
)
# what a program prints, not a command: `meshlm train: ...`, `meshlm layout: error: ...`
_OUTPUT = re.compile(r"^meshlm [\w-]+:")
_MARK = re.compile(r"^<!-- not run: (.*?) -->$")


@dataclass(frozen=True)
class Block:
    where: str  # doc:line of the opening fence
    lang: str
    lines: tuple[str, ...]
    mark: "str | None"  # the reason a `<!-- not run: ... -->` line before the fence gives


def _is_command(line: str) -> bool:
    s = line.strip()
    return bool(_COMMAND.match(s)) and not _OUTPUT.match(s.removeprefix("$ "))


def _blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a page (fences may be indented inside a list)."""
    lines = doc.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, indent, lang = i, m.group(1), m.group(2)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = lines[start - 1].strip() if start > 0 else ""
        mark = _MARK.match(before)
        out.append(Block(f"{doc.relative_to(REPO)}:{start + 1}", lang, tuple(body), mark and mark.group(1)))
        i += 1
    return out


def _join(lines: tuple[str, ...]) -> list[str]:
    """Lines with their backslash continuations joined."""
    out: list[str] = []
    cont = False
    for ln in lines:
        if cont:
            out[-1] = out[-1][:-1].rstrip() + " " + ln.strip()
        else:
            out.append(ln)
        cont = out[-1].rstrip().endswith("\\")
    return out


def normalize(command: str) -> str:
    """One spelling of a command: no prompt, no trailing comment, single spaces."""
    command = command.strip().removeprefix("$ ")
    command = re.split(r"\s#\s|\s#$", command, maxsplit=1)[0]
    return " ".join(command.split())


def commands(block: Block) -> list[str]:
    """The commands a shell block runs (a console block: its `$ ` lines; the rest is output)."""
    lines = _join(block.lines)
    if any(ln.startswith("$ ") for ln in lines):
        return [normalize(ln) for ln in lines if ln.startswith("$ ")]
    if block.lang in SHELL:
        return [normalize(ln) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if block.lang == "":
        return [normalize(ln) for ln in lines if _is_command(ln)]
    return []


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]
SHELL_BLOCKS = [b for b in BLOCKS if commands(b)]

# A documented command (as `normalize` spells it) -> the test that runs it, `path::function`.
# Each is run as written, or with only what makes it fit a test: fewer steps, a temporary
# directory. A command of this module's own `test_documented_command_runs` is run below.
_RESHARD = "tests/dist/test_docs_reshard.py::test_the_reshard_example_runs_as_written"
_PLAN_FORMULA = "tests/unit/test_docs_plan.py::test_formula_outputs_are_what_the_command_prints"
_HERE = f"{HERE}::test_documented_command_runs"
_70B = (
    "meshlm plan model=llama3_70b layout=auto plan.devices=256 plan.max_memory_per_device=80GiB "
    "plan.profile=h100_nvlink_ib train.batch_size=256 train.seq_len=8192 train.param_dtype=bfloat16 plan.method=formula"
)
RUN_BY: dict[str, str] = {
    # docs/checkpoint.md, Resharding
    "meshlm train model=llama_tiny train.steps=20 layout=fsdp mesh=fsdp4 checkpoint.dir=runs/ck checkpoint.every=10": (
        _RESHARD
    ),
    "meshlm train model=llama_tiny train.steps=30 layout=fsdp_tp mesh=fsdp2_tp2 checkpoint.dir=runs/ck "
    "checkpoint.resume=auto": _RESHARD,
    "meshlm train model=llama_tiny train.steps=40 layout=tp mesh=tp2 checkpoint.dir=runs/ck checkpoint.resume=auto": (
        _RESHARD
    ),
    "meshlm train model=llama_tiny train.steps=50 layout=single mesh=cpu1 checkpoint.dir=runs/ck "
    "checkpoint.resume=auto": _RESHARD,
    # docs/plan.md: the outputs docs/plan/run.sh regenerates
    f"{_70B} train.activation_checkpointing=none": _PLAN_FORMULA,
    f"{_70B} train.activation_checkpointing=full plan.png=docs/plan_70b.png": _PLAN_FORMULA,
    "meshlm plan model=llama3_8b layout=auto plan.devices=1 plan.profile=h200_nvlink_ib train.batch_size=1 "
    "train.seq_len=4096 train.param_dtype=bfloat16 train.activation_checkpointing=full plan.method=formula "
    "plan.png=outputs/plan/offload.png": "tests/fake/test_plan_offload.py::test_docs_offload_example_is_what_the_command_prints",
    # run here
    "meshlm layout show fsdp_tp --model llama3_8b --mesh dp=8,fsdp=16,tp=8": _HERE,
    "meshlm layout show tp --model llama_small --mesh tp=3": _HERE,
    "meshlm layout show vlm_fsdp_tp --model vlm_small --mesh fsdp=2,tp=2": _HERE,
    "meshlm plan model=vlm_small layout=vlm_fsdp_tp mesh=fsdp2_tp2 train.seq_len=48": _HERE,
    "meshlm plan model=llama_tiny model.layers=4 layout=fsdp_pp mesh.fsdp=2 mesh.pp=2 mesh.tp=1 train.grad_accum=4 "
    "train.batch_size=8 train.seq_len=16": _HERE,
    "meshlm plan generate llama3_8b --max-memory-per-device 12GiB --batch 8 --context 4096 --dtype bfloat16": _HERE,
    "python -m meshlm.data.shapes data/shapes --samples 2000 --image-size 32 --seed 0 --text-only 0.1": _HERE,
}


def test_the_docs_hold_shell_commands():
    assert len(SHELL_BLOCKS) > 20 and sum(len(commands(b)) for b in SHELL_BLOCKS) > 60


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where for b in SHELL_BLOCKS])
def test_every_command_is_run_by_a_test_or_marked(block):
    if block.mark is not None:
        return
    missing = [c for c in commands(block) if c not in RUN_BY]
    assert not missing, (
        f"{block.where}: shell commands that no test runs: {missing}. Run each in a test and name that test in "
        f"RUN_BY ({HERE}), or put `<!-- not run: <why> -->` on the line before the block"
    )


def test_every_mark_gives_a_reason_and_precedes_a_block():
    marks = []
    for doc in DOCS:
        lines = doc.read_text().split("\n")
        for i, ln in enumerate(lines):
            if "<!-- not run" in ln and not ln.lstrip().startswith("`"):
                m = _MARK.match(ln.strip())
                where = f"{doc.relative_to(REPO)}:{i + 1}"
                assert m and len(m.group(1).split()) >= 3, f"{where}: write `<!-- not run: <why, in words> -->`"
                assert i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```"), (
                    f"{where}: a `not run` mark goes on the line right before the block it marks"
                )
                marks.append(where)
    assert marks


def test_no_command_hides_in_an_indented_block():
    """Indented (unfenced) code blocks would escape the checks above."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().split("\n")
        fence = False
        for i, ln in enumerate(lines):
            if ln.lstrip().startswith("```"):
                fence = not fence
            elif not fence and ln.startswith("    ") and i and not lines[i - 1].strip() and _is_command(ln):
                found.append(f"{doc.relative_to(REPO)}:{i + 1}")
    assert not found, f"put these commands in a fenced ```bash block: {found}"


def _test_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    file = REPO / path
    if not file.is_file():
        return False
    name = name.split("[")[0]
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


@pytest.mark.parametrize("command,node", sorted(RUN_BY.items()))
def test_registered_tests_exist(command, node):
    assert _test_exists(node), f"RUN_BY names {node} for `{command}`, and there is no such test"


def test_registered_commands_are_documented():
    documented = {c for b in SHELL_BLOCKS for c in commands(b)}
    stale = sorted(set(RUN_BY) - documented)
    assert not stale, f"RUN_BY holds commands that no page documents any more: {stale}"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    tests = readme[readme.index("\n## Tests\n") :]
    block = next(b for b in _blocks(REPO / "README.md") if b.lang in SHELL and "\n".join(b.lines) in tests)
    [command] = commands(block)
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip()]
    assert ci[-1] == command, f".ci/run ends with `{ci[-1]}`; the README's test command is `{command}`"


# --- the commands run here ------------------------------------------------------------------


def _runs_here() -> list[tuple[str, "tuple[str, ...] | None"]]:
    """Each command RUN_BY gives to this module, with the output its page quotes (if any)."""
    out = {}
    for b in SHELL_BLOCKS:
        lines = _join(b.lines)
        for i, ln in enumerate(lines):
            c = normalize(ln)
            if RUN_BY.get(c) != f"{HERE}::test_documented_command_runs":
                continue
            quoted = None
            if ln.startswith("$ "):
                rest = lines[i + 1 :]
                end = next((j for j, x in enumerate(rest) if x.startswith("$ ")), len(rest))
                quoted = tuple(rest[:end])
            if out.get(c) is None:
                out[c] = quoted
    return sorted(out.items())


RUNS_HERE = _runs_here()


@pytest.mark.parametrize("command,quoted", RUNS_HERE, ids=[c for c, _ in RUNS_HERE])
def test_documented_command_runs(command, quoted, capsys, monkeypatch, tmp_path):
    """Run in an empty directory: a `meshlm` command in this process, a `python` one as a child."""
    monkeypatch.chdir(tmp_path)
    words = shlex.split(command)
    if words[0] == "meshlm":
        from meshlm.app.cli import main

        rc = main(words[1:])
        cap = capsys.readouterr()
        printed = cap.out + cap.err
    else:
        assert words[0] == "python", command
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True)
        rc, printed = r.returncode, r.stdout + r.stderr
    printed = printed.replace(f"{REPO}/", "").rstrip("\n").splitlines()
    if quoted is None:
        assert rc == 0 and printed, f"`{command}` exited {rc}:\n" + "\n".join(printed[-20:])
    else:
        assert printed == list(quoted), f"`{command}` no longer prints what its page quotes"
