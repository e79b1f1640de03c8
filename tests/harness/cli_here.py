"""``meshlm ARGS`` through the command's entry point in this process."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace


def cli_here(*args) -> SimpleNamespace:
    """``meshlm ARGS`` in this process (one device, so no worker to start; a process start and
    torch import saved per command): its ``returncode``, ``stdout`` and ``stderr``."""
    from meshlm.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # the Hydra task and argparse exit by themselves
            code = e.code
    return SimpleNamespace(returncode=int(code or 0), stdout=out.getvalue(), stderr=err.getvalue())
