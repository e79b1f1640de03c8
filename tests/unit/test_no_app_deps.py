"""The library works without the ``meshlm`` command's dependencies (pyproject's ``app``
extra: Hydra, matplotlib, tqdm, Pillow; docs/architecture.md): in a fresh interpreter where
those modules are absent (harness.no_app), a tiny Llama is sharded on one process, trained a
step with ShardedOptimizer, checkpointed and loaded back, written as a Hugging Face
directory and loaded from it, and generates, and every library module imports; no library
module even looks an app module up (a caught ImportError would hide that).  The
same blocker stops ``meshlm train`` with one line that says to install ``meshlm[app]``,
which shows that it does block what the command imports."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.no_app import APP_DISTRIBUTIONS, APP_MODULES, refused, without_app

REPO = Path(__file__).resolve().parents[2]
HYDRA = ("hydra", "omegaconf")

# One process, world 1 (gloo): the library's workflow (docs/architecture.md), its numbers held
# against the same Llama unsharded (the loss) and against themselves (checkpoint, HF round trip).
LIBRARY = """
import json, sys
import torch
import meshlm
from meshlm.core.annotate import init_params
from meshlm.infer import generate
from meshlm.interop.hf import save_hf
from meshlm.models import llama_model
from meshlm.runtime.optim.sharded import ShardedOptimizer
from meshlm.train.checkpoint import load_checkpoint, save_checkpoint

out = sys.argv[1]
fields = dict(vocab=64, embed=32, layers=2, heads=4, kv_heads=2, mlp=64)
mesh = meshlm.make_mesh("dp=1")
tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def sharded():
    return meshlm.shard(llama_model(device="meta", **fields), "fsdp", mesh, seed=0)


plain = llama_model(device="cpu", **fields)
init_params(plain, 0)
model = sharded()
opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
loss = model(tokens, tokens)
torch.testing.assert_close(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, plain(tokens, tokens))
loss.backward()
opt.step()
opt.zero_grad()
trained = meshlm.full_state_dict(model)
assert any(not torch.equal(trained[k], v) for k, v in plain.state_dict().items() if k in trained)

ckpt = save_checkpoint(out + "/ckpt", 1, model=model, optimizer=opt, extra={"step": 1})
again = sharded()
extra = load_checkpoint(ckpt, model=again, optimizer=ShardedOptimizer(again, torch.optim.AdamW, lr=1e-2))
assert extra["step"] == 1
for k, v in meshlm.full_state_dict(again).items():
    assert torch.equal(v, trained[k]), k

hf = save_hf(model, out + "/hf")
loaded = meshlm.load_hf(hf, "fsdp", mesh).eval()
for k, v in meshlm.full_state_dict(loaded).items():
    assert torch.equal(v, trained[k]), k
new = generate(loaded, [[1, 2, 3]], max_new_tokens=4)
assert len(new) == 1 and len(new[0]) == 4, new

app = sorted(m for m in sys.modules if m.partition(".")[0] in json.loads(sys.argv[2]))
print(json.dumps(app))
"""


# Every module of the library (all but meshlm.app) imports; an app module may be imported
# only inside the function that needs it (a plot, a progress bar, the images data).
MODULES = """
import importlib, json, pkgutil, sys
import meshlm

names = [m.name for m in pkgutil.walk_packages(meshlm.__path__, "meshlm.") if not m.name.startswith("meshlm.app")]
for name in names:
    importlib.import_module(name)
print(json.dumps(names))
"""


def _run(code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return without_app(tmp_path, env)


def test_the_library_runs_without_the_app_dependencies(tmp_path):
    env = _env(tmp_path)
    r = _run(LIBRARY, env, str(tmp_path), json.dumps(APP_MODULES))
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []
    ours = [(m, by) for m, by in refused(env) if by.partition(".")[0] == "meshlm"]
    assert ours == [], f"the library looked for the app's modules: {ours}"


def test_every_library_module_imports_without_the_app_dependencies(tmp_path):
    env = _env(tmp_path)
    r = _run(MODULES, env)
    assert r.returncode == 0, r.stderr[-4000:]
    names = json.loads(r.stdout.splitlines()[-1])
    assert {"meshlm.data.images", "meshlm.plan.plot", "meshlm.models.node", "meshlm.train.metrics"} <= set(names)
    ours = [(m, by) for m, by in refused(env) if by.partition(".")[0] == "meshlm"]
    assert ours == [], f"importing the library looked for the app's modules: {ours}"


def test_no_library_module_imports_hydra():
    """Hydra is the command's config system: no module outside meshlm/app imports hydra or
    omegaconf, not even inside a function (the library's config sections are dataclasses)."""
    found = []
    for f in sorted((REPO / "meshlm").rglob("*.py")):
        if "app" in f.relative_to(REPO / "meshlm").parts[:1]:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{f.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in HYDRA]
    assert not found, f"library modules import Hydra (move the code into meshlm/app): {found}"


def test_meshlm_train_without_the_app_dependencies_says_to_install_them(tmp_path):
    """The blocker does block: ``meshlm train`` (meshlm.app.cli) looks for Hydra and stops
    with one line naming ``meshlm[app]`` before any process starts; its train command, run
    past that check, fails on ``import hydra``."""
    env = _env(tmp_path)
    r = _run("import sys; from meshlm.app.cli import main; sys.exit(main(['train', 'train.steps=1']))", env)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'meshlm[app]'" in lines[0] and "'hydra'" in lines[0], r.stderr[-3000:]
    assert ("hydra", "meshlm.app.cli") in refused(env), refused(env)
    r = _run(
        "from meshlm.app.cli import train_main\n"
        "try:\n"
        "    train_main(['train.steps=1'])\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name)",
        env,
    )
    assert r.returncode == 0 and r.stdout.split() == ["hydra"], (r.stdout, r.stderr[-3000:])


def test_the_blocked_modules_are_the_app_extra():
    """harness.no_app blocks exactly the distributions of pyproject's ``app`` extra, and none
    of them is a dependency of the library."""
    from meshlm.app import cli

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs):
        import re

        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}

    assert names(project["optional-dependencies"]["app"]) == set(APP_DISTRIBUTIONS)
    assert not names(project["dependencies"]) & set(APP_DISTRIBUTIONS)
    assert set(APP_MODULES) == set(cli.APP_MODULES)  # what the command checks for
