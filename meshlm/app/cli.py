"""The ``meshlm`` command.  The only module that imports Hydra for an app; it turns the
DictConfig into a typed :class:`meshlm.app.config.RunConfig` at once.

    meshlm train [key=value ...]          train (a Hydra app over conf/); -m for a sweep
    meshlm plan [key=value ...]           rank layouts and meshes for a model and hardware
                                          (every command: layout=... mesh=... model=..., --config-dir DIR, -m, --cfg job)
    meshlm plan generate SOURCE --max-memory-per-device SIZE   inference placement, KV cache
    meshlm convert ...                    Hugging Face <-> meshlm checkpoints
    meshlm generate SOURCE --prompt TEXT [layout=tp mesh=tp2]   text from a Hugging Face directory or a checkpoint
    meshlm serve SOURCE [--port 8000] [layout=... mesh=...]     an OpenAI-compatible completions server
    meshlm layout show LAYOUT --model NAME --mesh fsdp=2,tp=2 [model.KEY=VALUE ...]
    meshlm layout list                    the layouts by name, and the files they are in
    meshlm diff [KEY=VALUE] [a.KEY=VALUE] [b.KEY=VALUE]   one step under two configurations: where they disagree
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from meshlm.core.errors import ConfigError, MeshlmError

USAGE = __doc__.split("\n\n", 1)[1].rstrip() + "\n"

#: the top-level modules of pyproject.toml's ``app`` extra (hydra-core, matplotlib, tqdm,
#: pillow, prometheus-client): what the command needs beyond the library (docs/architecture.md)
APP_MODULES = ("hydra", "omegaconf", "matplotlib", "PIL", "tqdm", "prometheus_client")

# Filled in by the Hydra task (one process runs every job of a sweep, in turn).
_SWEEP: dict[str, Any] = {"dir": None, "failed": 0, "jobs": 0}


def resolve_auto(cfg):
    """``layout=auto``: let ``meshlm.app.plan.choose_layout`` pick the layout and mesh."""
    from meshlm.app.config import LayoutConfig, MeshConfig

    if cfg.layout.name != "auto":
        return cfg
    try:
        from meshlm.app.plan import choose_layout
    except ImportError as e:
        raise ConfigError(f"layout=auto needs meshlm.plan ({e}); name a layout instead, e.g. layout=fsdp_tp") from None
    choice = choose_layout(cfg)
    name, mesh = choice
    cfg = dataclasses.replace(cfg, layout=LayoutConfig(name=name), mesh=MeshConfig(**dict(mesh)))
    if getattr(choice, "offload", None):  # the winner fits only with these offloaded (and says so)
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, **choice.offload))
    return cfg


def _record_error(e: BaseException) -> None:
    """Under torchrun, write the error file its agent reports as the root cause."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)


def _train_task(dc) -> None:
    import yaml
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from meshlm.app.config import from_dict
    from meshlm.app.launch import launch, prestart

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:
        _SWEEP["dir"] = hc.sweep.dir
    _SWEEP["jobs"] += 1
    run_dir = Path(hc.runtime.output_dir)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    # as the user wrote them: model.KEY=VALUE reaches Hydra as ++model.KEY=VALUE (open_overrides)
    over = [o.removeprefix("++") if o.startswith(("++model.", "++optim.")) else o for o in hc.overrides.task]
    job = {"num": hc.job.get("num", 0) if multirun else 0, "overrides": over}
    try:
        raw = OmegaConf.to_container(dc, resolve=True)
        if isinstance(raw.get("mesh"), dict):
            prestart(raw["mesh"])  # the workers' imports overlap this process's (docs/train.md, "Start-up time")
        cfg = resolve_auto(from_dict(raw))
        if multirun and cfg.logger.group is None:  # a sweep's runs are one group (NOTE [experiment tracking])
            cfg = dataclasses.replace(cfg, logger=dataclasses.replace(cfg.logger, group=str(hc.sweep.dir)))
        eff = _effective(cfg)  # under layout.strict=true, a degenerate layout stops here
        if main_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            head = (
                ""
                if eff is None
                else "".join(
                    f"# {line}\n" for line in [f"effective on mesh {cfg.mesh}: {eff.summary()}", *eff.problems()]
                )
            )
            (run_dir / "config.yaml").write_text(head + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            _write_job(run_dir, job)
        _exit_if_stopped(launch(cfg, run_dir))
    except Exception as e:  # noqa: BLE001 - a sweep goes on with its other jobs (below)
        if not isinstance(e, MeshlmError) and not multirun:
            raise
        _record_error(e)
        if isinstance(e, MeshlmError):
            print(f"meshlm train: error: {e}", file=sys.stderr, flush=True)
        else:
            import traceback

            traceback.print_exc()
        _SWEEP["failed"] += 1
        if main_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_job(
                run_dir, {**job, "error": f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__}
            )
        if not multirun:
            sys.exit(1)


def _exit_if_stopped(summary) -> None:
    """A run stopped by SIGTERM/SIGINT exits with status 128 + the signal number (143, 130;
    NOTE [stopping on a signal] in meshlm/train/lifecycle.py), a sweep included."""
    import signal

    name = (summary or {}).get("stopped_by")
    if not name:
        return
    if summary.get("stop_line"):  # the workers did not stop on it, so rank 0 said nothing (meshlm.app.launch.stop_line)
        print(f"meshlm train: {summary['stop_line']}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.exit(128 + int(getattr(signal, name)))


def _effective(cfg):
    """The layout on the configured mesh (NOTE [effective sharding] in meshlm/layout/effective.py),
    or None while a mesh axis is -1 (train.run checks it once the world size is known)."""
    from meshlm.core.axes import MESH_AXES
    from meshlm.layout.effective import check
    from meshlm.layout.rules import load_layout

    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    if -1 in sizes.values():
        return None
    return check(load_layout(cfg.layout.name), sizes, cfg.layout.strict)


def _write_job(run_dir: Path, job: dict) -> None:
    """``job.json``: the sweep's job number, its overrides and, if it failed, its error."""
    import json

    (run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")


def train_main(argv: list[str]) -> int:
    """``meshlm train``: Hydra parses ``argv`` (overrides, ``-m``, ``--cfg job`` ...)."""
    import hydra

    from meshlm.app.config import check_overrides, conf_dir, open_overrides, register_defaults

    argv = list(argv)
    check_overrides(argv)
    argv = open_overrides(argv)
    if os.environ.get("RANK") is not None and not any(a.startswith("hydra.run.dir=") for a in argv):
        # Under torchrun every rank must agree on the run directory; its run id is shared.
        rid = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        argv.append(f"hydra.run.dir=outputs/torchrun-{rid}")
    register_defaults()  # every key's default, from the dataclasses (NOTE [config defaults] in meshlm/app/config.py)
    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_train_task)
    _SWEEP.update(dir=None, failed=0, jobs=0)
    saved = sys.argv
    sys.argv = ["meshlm-train", *argv]
    try:
        app()
    finally:
        sys.argv = saved
    if _SWEEP["dir"]:
        from meshlm.app.sweep import summarize_sweep

        out = summarize_sweep(_SWEEP["dir"])
        if out is not None:
            print(out.read_text(), end="")
            print(
                f"sweep summary: {out}, {out.with_suffix('.csv')}, {out.with_suffix('.png')}, {out.parent / 'curves.png'}",
                flush=True,
            )
        if _SWEEP["failed"]:
            print(f"meshlm train: {_SWEEP['failed']} of {_SWEEP['jobs']} runs failed", file=sys.stderr)
    return 1 if _SWEEP["failed"] else 0


def plan_cmd(argv: list[str]) -> int:
    if argv[:1] == ["generate"]:  # inference placement (docs/inference.md)
        from meshlm.app.infer_plan import plan_generate_main

        return plan_generate_main(argv[1:])
    from meshlm.app.config import compose, load_config
    from meshlm.app.grammar import split_hydra, sweep
    from meshlm.app.plan import plan_main

    # Hydra's flags, as meshlm train takes them (NOTE [one grammar] in meshlm/app/grammar.py)
    flags = split_hydra(argv, "meshlm plan")
    rc = 0
    for over in sweep(flags.rest, flags.multirun):
        if flags.multirun:
            print(f"# meshlm plan {' '.join(over)}", flush=True)
        full = [*over, *flags.searchpath()]
        if flags.cfg:  # what would be planned, and nothing else
            import yaml

            print(yaml.safe_dump(compose(full), sort_keys=False), end="")
            continue
        rc = max(rc, int(plan_main(load_config(full), over) or 0))
    return rc


def convert_cmd(argv: list[str]) -> int:
    from meshlm.train.convert import convert_main

    return int(convert_main(argv) or 0)


def layout_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="meshlm layout", description="Inspect a layout.")
    sub = p.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser(
        "show",
        help="the placement of every parameter of a model under a layout and mesh",
        epilog="Any model: model.KEY=VALUE overrides as for meshlm train, e.g. "
        "model._target_=mypkg.MyModel model.width=64",
    )
    show.add_argument("layout", help="a layout name (layouts/<name>.yaml) or a YAML path")
    show.add_argument(
        "--model",
        default=None,
        help="a shipped model config name (default: llama_tiny, unless model._target_ is given)",
    )
    show.add_argument("--mesh", default="fsdp=2,tp=2", help="mesh, e.g. fsdp=2,tp=2 (default)")
    sub.add_parser("list", help="every layout name, the file it loads and its first sentence")
    a, overrides = p.parse_known_args(argv)
    if a.cmd == "list":
        if overrides:
            p.error(f"unrecognized arguments: {' '.join(overrides)}")
        print(layout_list())
        return 0
    from meshlm.app.config import load_config
    from meshlm.app.show import layout_table

    bad = [o for o in overrides if not o.lstrip("+").startswith("model.")]
    if bad:
        raise ConfigError(
            f"show: {bad[0]!r} is not a model.KEY=VALUE override; give the layout "
            "as the first argument and the mesh as --mesh"
        )
    custom = any(o.lstrip("+").startswith("model._target_=") for o in overrides)
    group = [f"model={a.model}"] if a.model else [] if custom else ["model=llama_tiny"]
    print(layout_table(load_config(group + overrides).model, a.layout, a.mesh))
    return 0


def layout_list() -> str:
    """``meshlm layout list``: the directories ``load_layout`` searches, in order, and each
    name it resolves, with the file it loads (the first directory that has it) and the first
    sentence of the file's header comment."""
    from meshlm.layout.rules import layout_dirs

    dirs = layout_dirs()
    rows: dict[str, tuple[Path, str]] = {}
    for d in dirs:
        for f in sorted(d.glob("*.yaml")) if d.is_dir() else []:
            if f.stem not in rows:
                head = " ".join(ln.lstrip("#").strip() for ln in f.read_text().splitlines() if ln.startswith("#"))
                head = head.removeprefix(f"{f.stem}:").strip()
                rows[f.stem] = (f, head.split(". ")[0].rstrip(".") + "." if head else "")
    env = {Path(p) for p in os.environ.get("MESHLM_LAYOUTS", "").split(os.pathsep) if p}
    out = ["layout directories, searched in this order ($MESHLM_LAYOUTS first):"]
    out += [f"  {d}{'' if d.is_dir() else ' (missing)'}" for d in dirs if d.is_dir() or d in env]
    w = max((len(n) for n in rows), default=0)
    out += [""] + [f"{n:<{w}}  {f}\n{'':<{w}}  {head}".rstrip() for n, (f, head) in rows.items()]
    out += [
        "",
        "Your own layout: copy one of these files into a directory, set MESHLM_LAYOUTS to it and pass "
        "the name (meshlm train layout.name=NAME), or pass a path (layout.name=path/to/file.yaml).",
    ]
    return "\n".join(out)


def generate_cmd(argv: list[str]) -> int:
    from meshlm.app.generate import generate_main

    return generate_main(argv)


def serve_cmd(argv: list[str]) -> int:
    from meshlm.app.serve import serve_main

    return serve_main(argv)


def diff_cmd(argv: list[str]) -> int:
    from meshlm.app.diff import diff_main

    return diff_main(argv)


COMMANDS = {
    "train": train_main,
    "plan": plan_cmd,
    "convert": convert_cmd,
    "generate": generate_cmd,
    "serve": serve_cmd,
    "layout": layout_cmd,
    "diff": diff_cmd,
}


def missing_app_modules() -> list[str]:
    """The modules of the ``app`` extra that are not installed (a lookup, no import: the
    launcher's start-up stays as fast: docs/train.md, "Start-up time")."""
    import importlib.util

    missing = []
    for name in APP_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _needs_app(missing: "list[str]") -> str:
    return (
        f"the meshlm command needs the app dependencies (Hydra, matplotlib, tqdm, Pillow), and "
        f"{', '.join(repr(m) for m in missing)} cannot be imported; install them with: pip install 'meshlm[app]' "
        "(the library, import meshlm, needs none of them)"
    )


def main(argv: "list[str] | None" = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"meshlm: unknown command {cmd!r}; choose one of: {', '.join(COMMANDS)}\n\n{USAGE}")
        return 2
    missing = missing_app_modules()
    if missing:  # before a worker starts: the workers import tqdm, a sweep's end matplotlib
        print(f"meshlm {cmd}: error: {_needs_app(missing)}", file=sys.stderr)
        return 1
    try:
        return COMMANDS[cmd](rest)
    except MeshlmError as e:
        _record_error(e)
        print(f"meshlm {cmd}: error: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # found above, yet it does not import (a broken install)
        if (e.name or "").partition(".")[0] not in APP_MODULES:
            raise
        print(f"meshlm {cmd}: error: {_needs_app([e.name or ''])}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
