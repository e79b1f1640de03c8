"""docs/checkpoint.md's resharding example runs as written: its four ``meshlm train``
commands, in an empty directory, each exit 0 and print the ``resumed from`` lines the page
quotes (with the run id the first command chose)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "checkpoint.md"


def _section() -> str:
    text = DOC.read_text()
    return text[text.index("## Resharding"):text.index("Each rank reads only the chunks")]


def _blocks(section: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", section, re.S)


def test_the_reshard_example_runs_as_written(tmp_path):
    commands, quoted = _blocks(_section())[:2]
    commands = [c for c in commands.splitlines() if c.strip()]
    quoted = [q for q in quoted.splitlines() if q.strip()]
    assert len(commands) == 4 and all(c.startswith("meshlm train ") for c in commands)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    printed = []
    for c in commands:
        r = subprocess.run([sys.executable, "-m", "meshlm.app.cli", *shlex.split(c)[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (c, r.stderr[-3000:])
        printed += [ln for ln in r.stdout.splitlines() if "resumed from" in ln]
    run_id = json.loads((tmp_path / "runs" / "ck" / "run.json").read_text())["run_id"]
    assert printed == [q.replace("RUN_ID", run_id) for q in quoted]
