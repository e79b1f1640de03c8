"""An installed meshlm works away from the repository: a wheel built from it holds every
module, shipped layout and Hydra config and no test harness, and, installed into a fresh
virtualenv and run from an empty directory, loads layouts, shows one and trains (2 CPU
processes); with the ``app`` extra's modules absent there (harness.no_app), the library
still shards a model and the ``meshlm`` command says to install ``meshlm[app]``.

The virtualenv gets only the wheel (``--no-deps``); torch, Hydra and the other
dependencies come from this environment's site-packages, listed in a ``.pth`` file after
the virtualenv's own, so the wheel's ``meshlm`` is the one imported (checked: every
process reports where its ``meshlm``, layouts and configs come from). This environment's
own meshlm (an editable install, or PYTHONPATH) is not visible there: ``.pth`` files of a
directory that a ``.pth`` file adds are not run, and PYTHONPATH is cleared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.no_app import APP_DISTRIBUTIONS, APP_MODULES, refused, without_app

REPO = Path(__file__).resolve().parents[2]
# What a wheel is built from (pyproject.toml reads README.md as the long description).
SOURCES = ("pyproject.toml", "README.md", "meshlm", "layouts", "conf")
# Variables that would point the installed meshlm back at the repository, or into a world.
CLEARED = (
    "PYTHONPATH",
    "PYTHONHOME",
    "MESHLM_LAYOUTS",
    "MESHLM_CONF",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)

pytestmark = [pytest.mark.install, pytest.mark.timeout(300)]


def _run(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    what = " ".join(map(str, cmd))
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built, as `pip wheel .` builds one, from a copy of the sources (so that the
    build leaves no build/ or *.egg-info in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        p = REPO / name
        (shutil.copytree(p, src / name, ignore=junk) if p.is_dir() else shutil.copy2(p, src / name))
    out = tmp_path_factory.mktemp("wheel")
    # The environment's setuptools (the `test` extra pins one that builds wheels): no index needed.
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, src],
        timeout=120,
    )
    (whl,) = out.glob("meshlm-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed and this environment's packages behind it."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=60)
    py = venv / "bin" / "python"
    purelib = Path(
        _run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout=60, env=_env(venv)
        ).stdout.strip()
    )
    parents = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        parents.append(site.getusersitepackages())
    # "zz" sorts after any .pth the wheel might bring; the paths go after the venv's own.
    (purelib / "zz_parent_env.pth").write_text("".join(f"{p}\n" for p in parents if Path(p).is_dir()))
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], timeout=120, env=_env(venv))
    return venv


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_wheel_holds_every_module_layout_and_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(REPO).as_posix() for p in (REPO / "meshlm").rglob("*.py") if "__pycache__" not in p.parts}
    want |= {f"meshlm/layouts/{p.name}" for p in (REPO / "layouts").glob("*.yaml")}
    want |= {f"meshlm/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    assert len(want) > 60 and {"meshlm/layouts/fsdp_tp.yaml", "meshlm/conf/config.yaml"} <= want
    got = {n for n in names if n.endswith((".py", ".yaml"))}
    assert not want - got, f"the wheel lacks {sorted(want - got)}: list their packages in pyproject's [tool.setuptools]"
    assert not got - want, f"the wheel holds files the checkout does not: {sorted(got - want)}"
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "meshlm").rglob("__init__.py")}
    assert {"meshlm/app", "meshlm/runtime/lowering", "meshlm/interop/hf"} <= packages
    assert all(f"{p}/__init__.py" in names for p in packages), sorted(
        p for p in packages if f"{p}/__init__.py" not in names
    )
    harness = sorted(n for n in names if n.startswith("meshlm/testing/") or {"harness", "tests"} & set(n.split("/")))
    assert not harness, f"the wheel holds the test harness: {harness}"


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_wheel_requires_only_the_library_without_the_app_extra(wheel):
    """The wheel's metadata: the app's distributions are required only with ``[app]``."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    always = {_dist(r) for r in reqs if ";" not in r}
    with_app = {_dist(r) for r in reqs if r.replace(" ", "").endswith('extra=="app"')}
    assert "torch" in always and not always & set(APP_DISTRIBUTIONS), always
    assert with_app == set(APP_DISTRIBUTIONS), reqs


# One interpreter for the library checks (each start imports torch: seconds on a busy machine).
PROBE = """
import json, sysconfig, meshlm
from meshlm.app.cli import layout_list
from meshlm.app.config import conf_dir
from meshlm.layout.rules import load_layout, shipped_layouts
print(json.dumps({"site": sysconfig.get_path("purelib"), "meshlm": meshlm.__file__, "conf": str(conf_dir()),
                  "fsdp": load_layout("fsdp").source, "shipped": shipped_layouts(), "mine": load_layout("mine").source,
                  "list": layout_list()}))
"""


def test_installed_wheel_runs_from_an_empty_directory(venv, tmp_path):
    env = _env(venv)
    cwd = tmp_path / "work"
    cwd.mkdir()
    mine = tmp_path / "my_layouts"
    mine.mkdir()
    (mine / "mine.yaml").write_text("# mine: a user's layout.\nparams:\n  embed: fsdp\n")

    # the library: layouts and configs from the installed package, a user's layout directory too
    probe = json.loads(
        _run(
            [venv / "bin" / "python", "-c", PROBE], timeout=120, cwd=cwd, env={**env, "MESHLM_LAYOUTS": str(mine)}
        ).stdout.splitlines()[-1]
    )
    site_dir = Path(probe["site"]) / "meshlm"
    assert Path(probe["site"]).is_relative_to(venv), probe
    assert probe["meshlm"] == str(site_dir / "__init__.py"), probe
    assert probe["conf"] == str(site_dir / "conf") and probe["fsdp"] == str(site_dir / "layouts" / "fsdp.yaml")
    assert set(probe["shipped"]) == {p.stem for p in (REPO / "layouts").glob("*.yaml")} | {"mine"}
    assert probe["mine"] == str(mine / "mine.yaml")
    assert str(site_dir / "layouts" / "fsdp_tp.yaml") in probe["list"], probe["list"][:500]

    r = _run(
        [venv / "bin" / "meshlm", "layout", "show", "fsdp", "--model", "llama_tiny", "--mesh", "fsdp=2"],
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert f"layout fsdp ({site_dir / 'layouts' / 'fsdp.yaml'}) on mesh fsdp=2" in r.stdout, r.stdout[:500]

    # the Hydra app: the packaged conf/, the run directory under the current directory
    r = _run(
        [
            venv / "bin" / "meshlm",
            "train",
            "model=llama_tiny",
            "layout=fsdp",
            "mesh=fsdp2",
            "train.steps=2",
            "train.seq_len=32",
            "train.batch_size=4",
            "train.warmup_steps=0",
            "train.val_every=0",
            "train.val_batches=1",
            "train.progress=false",
            "train.count_comm=false",
            "train.pg_timeout_s=60",
        ],
        timeout=240,
        cwd=cwd,
        env=env,
    )
    assert "done: 2 steps" in r.stdout, r.stdout[-2000:]
    assert [p.name for p in cwd.iterdir()] == ["outputs"], "meshlm train wrote outside outputs/"
    (run_dir,) = [p.parent for p in (cwd / "outputs").rglob("metrics.jsonl")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2]
    assert (run_dir / "logs" / "rank1.log").exists(), "the run did not use 2 processes"


# The library alone: one process, a 1-device mesh.
LIBRARY = """
import json, sys, meshlm
from meshlm.models import llama_model
model = meshlm.shard(llama_model(device="meta", vocab=64, embed=32, layers=1, heads=4, kv_heads=2, mlp=64), "fsdp",
                     meshlm.make_mesh("dp=1"))
print(json.dumps({"meshlm": meshlm.__file__, "params": len(meshlm.full_state_dict(model)),
                  "app": sorted(m for m in sys.modules if m.split(".")[0] in json.loads(sys.argv[1]))}))
"""


def test_installed_wheel_without_the_app_extra(venv, tmp_path):
    """With the app's modules absent from the fresh virtualenv, ``import meshlm;
    meshlm.shard`` works from the installed wheel, and the ``meshlm`` command stops with one
    line that names ``meshlm[app]``."""
    env = without_app(tmp_path, _env(venv))
    cwd = tmp_path / "work"
    cwd.mkdir()
    out = _run([venv / "bin" / "python", "-c", LIBRARY, json.dumps(APP_MODULES)], timeout=120, cwd=cwd, env=env)
    got = json.loads(out.stdout.splitlines()[-1])
    assert Path(got["meshlm"]).is_relative_to(venv) and got["params"] > 0 and got["app"] == [], got
    assert not [r for r in refused(env) if r[1].startswith("meshlm")], refused(env)

    r = subprocess.run(
        [str(venv / "bin" / "meshlm"), "train", "train.steps=1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "pip install 'meshlm[app]'" in lines[0], (r.returncode, r.stderr)
    assert not list(cwd.iterdir()), "meshlm train wrote files without its dependencies"
