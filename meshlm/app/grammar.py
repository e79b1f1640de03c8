"""One command grammar: Hydra's flags and ``key=value`` overrides for every ``meshlm`` command.

NOTE [one grammar]
    ``meshlm train`` is a Hydra app; the other commands take the same spelling:

    - overrides of the config (``layout=tp``, ``mesh=tp2``, ``mesh.tp=2``, ``model=mine``,
      ``model.init_from=DIR``), composed from ``conf/`` as ``train`` composes them;
    - Hydra's own flags: ``--config-dir DIR`` (``-cd``: a directory of your own groups,
      searched after the shipped ``conf/``, e.g. ``DIR/model/mine.yaml``), ``-m`` (a sweep:
      every combination of the comma-separated values, one after another), ``--cfg job``
      (print what would run, and exit) with ``--resolve``.

    ``meshlm plan`` composes a whole run config.  ``meshlm generate`` and ``meshlm serve``
    read from it where to run: ``layout=`` and ``mesh=`` (the flags ``--layout`` and
    ``--mesh fsdp=2,tp=2`` are the same thing, kept as aliases), and ``model.init_from=DIR``
    as the model to load (the SOURCE argument's alias).  So a mesh is written one way
    everywhere, and ``meshlm generate -m layout=tp,single mesh=tp2,cpu1 ...`` is an
    inference sweep.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from meshlm.core.errors import ConfigError

VALUED = {"--cfg": "cfg", "-c": "cfg", "--config-dir": "config_dir", "-cd": "config_dir"}
SWITCHES = {"-m": "multirun", "--multirun": "multirun", "--resolve": "resolve"}
UNSUPPORTED = ("--config-name", "-cn", "--config-path", "-cp", "--package", "-p", "--info", "-i")
#: what generate and serve take from the config: ``layout``, ``mesh`` and ``model.init_from``
INFERENCE_KEY = re.compile(r"^(layout|mesh|model)(\.\w+)*=")


@dataclass
class HydraFlags:
    """Hydra's flags given to a command (NOTE [one grammar])."""

    multirun: bool = False
    cfg: Optional[str] = None
    resolve: bool = False
    config_dir: Optional[str] = None
    rest: list = field(default_factory=list)

    def searchpath(self) -> list[str]:
        """The override that adds ``--config-dir`` to Hydra's search path (or none)."""
        if self.config_dir is None:
            return []
        d = Path(self.config_dir).expanduser().resolve()
        if not d.is_dir():
            raise ConfigError(f"--config-dir {self.config_dir}: no such directory (a directory of config groups)")
        return [f"hydra.searchpath=[file://{d}]"]


def split_hydra(argv: list[str], prog: str) -> HydraFlags:
    """Hydra's flags out of ``argv``; the rest, in order, in ``.rest``."""
    out = HydraFlags()
    it = iter(argv)
    for a in it:
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if name in VALUED:
            v = val if eq else next(it, None)
            if v is None:
                raise ConfigError(f"{prog}: {name} needs a value")
            setattr(out, VALUED[name], v)
        elif a in SWITCHES:
            setattr(out, SWITCHES[a], True)
        elif name in UNSUPPORTED:
            raise ConfigError(f"{prog}: {name} is for meshlm train only; use --config-dir DIR with overrides")
        else:
            out.rest.append(a)
    if out.cfg not in (None, "job", "all", "hydra"):
        raise ConfigError(f"{prog}: --cfg {out.cfg}: choose job (or all, hydra)")
    return out


def sweep(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The runs of a command: one, or under ``-m`` every combination of the comma-separated
    values (``layout=tp,single`` is two runs; a list in brackets is one value)."""
    if not multirun:
        return [list(overrides)]
    options = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and "," in value and not value.startswith(("[", "{")) and "(" not in value:
            options.append([f"{key}={v}" for v in value.split(",")])
        else:
            options.append([o])
    return [list(c) for c in itertools.product(*options)]


def inference_argv(argv: list[str], prog: str) -> tuple[HydraFlags, list[tuple[list[str], list[str]]]]:
    """``meshlm generate``/``serve`` arguments in the one grammar, as their own flags: per
    run (one, or a sweep's), the overrides it came from and the argv with ``--layout``,
    ``--mesh`` and SOURCE in their place (NOTE [one grammar])."""
    flags = split_hydra(argv, prog)
    overrides = [a for a in flags.rest if INFERENCE_KEY.match(a)]
    rest = [a for a in flags.rest if not INFERENCE_KEY.match(a)]
    runs = []
    for over in sweep(overrides, flags.multirun):
        runs.append((over, rest + _as_flags(over, flags, prog) if over else list(rest)))
    return flags, runs


def _as_flags(overrides: list[str], flags: HydraFlags, prog: str) -> list[str]:
    from meshlm.app.config import load_config

    keys = {o.split("=", 1)[0].split(".")[0] for o in overrides}
    bad = [o for o in overrides if o.startswith("model") and not o.startswith("model.init_from=")]
    if bad:
        raise ConfigError(
            f"{prog}: {bad[0]}: the model to load is a Hugging Face directory or a checkpoint: give it as SOURCE "
            "or model.init_from=DIR"
        )
    # a placeholder model: the overrides choose where to run; model.init_from is read, not built
    cfg = load_config([*overrides, *flags.searchpath(), *([] if "model" in keys else ["model=llama_tiny"])])
    out = []
    if "layout" in keys:
        out += ["--layout", cfg.layout.name]
    if "mesh" in keys:
        out += ["--mesh", str(cfg.mesh)]
    if cfg.model.init_from and "model" in keys:
        out += [cfg.model.init_from]
    return out
