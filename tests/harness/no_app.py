"""The ``meshlm`` command's own dependencies (the ``app`` extra) made absent for one
subprocess and every process it starts, as in an environment that installed meshlm
without ``[app]``: a ``sitecustomize`` on ``PYTHONPATH`` swaps ``sys.meta_path``'s path
finder for one that does not see those modules (``import`` raises the ModuleNotFoundError
of an absent package, ``importlib.util.find_spec`` gives None, as torch's probes expect)
and logs each lookup with the module that made it, so that code which catches the error
and goes on is still seen."""

from __future__ import annotations

import os
from pathlib import Path

#: each distribution of pyproject.toml's ``app`` extra -> the top-level modules it installs
APP_DISTRIBUTIONS = {
    "hydra-core": ("hydra", "omegaconf"),  # omegaconf comes with hydra-core
    "matplotlib": ("matplotlib",),
    "tqdm": ("tqdm",),
    "pillow": ("PIL",),
    "prometheus-client": ("prometheus_client",),
}
APP_MODULES = tuple(m for mods in APP_DISTRIBUTIONS.values() for m in mods)
LOG = "MESHLM_TEST_BLOCKED_LOG"  # the file each refused lookup is appended to

_SITECUSTOMIZE = '''\
import importlib.machinery, os, sys

BLOCKED = {blocked!r}


class _Absent(importlib.machinery.PathFinder):
    """sys.path's finder, blind to the app's modules: importing one raises the
    ModuleNotFoundError of an absent package, and find_spec gives None, as it would."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return super().find_spec(name, path, target)
        f = sys._getframe(1)
        while f is not None and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename):
            f = f.f_back
        caller = f.f_globals.get("__name__", "?") if f is not None else "?"
        with open(os.environ[{log!r}], "a") as log:
            log.write(f"{{name}} {{caller}}\\n")
        return None


sys.meta_path[:] = [_Absent if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def without_app(tmp_path: Path, env: "dict[str, str] | None" = None) -> dict[str, str]:
    """``env`` (default: this process's) for a subprocess in which the app's modules are
    absent; :func:`refused` reads what it tried to import."""
    d = tmp_path / "no_app"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(blocked=APP_MODULES, log=LOG))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(d), env.get("PYTHONPATH", "")) if p)
    env[LOG] = str(tmp_path / "refused.log")
    return env


def refused(env: dict[str, str]) -> list[tuple[str, str]]:
    """``(module, looked up by)`` for each lookup of an app module refused in the
    subprocesses run with ``env``, in order."""
    log = Path(env[LOG])
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] if log.exists() else []
