"""What a benchmark records about the run around its figures: the machine's load before and
after (``uptime``'s 1, 5 and 15 minute averages; the machine is shared) and the commit measured."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"
