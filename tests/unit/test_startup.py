"""The ``meshlm`` command's start-up (docs/train.md, "Start-up time"):
the launcher imports neither torch nor DTensor before it has composed the config, so the
forkserver ``launch.prestart`` starts imports them while the launcher checks the config;
``meshlm``'s public names still load on first use.  Each check runs in a fresh interpreter,
as the command does (this test process has long imported torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_launcher_modules_import_no_torch():
    out = _python(
        "import sys, json\n"
        "import meshlm, meshlm.app.cli, meshlm.app.config, meshlm.app.launch, meshlm.layout.effective, meshlm.layout.rules\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))"
    )
    assert json.loads(out) == []


def test_every_public_name_loads_on_first_use():
    """Each name of ``meshlm.__all__`` resolves to the object its home module defines, and
    an unknown name is still an AttributeError."""
    out = _python(
        "import json, importlib, meshlm\n"
        "res = {n: (getattr(meshlm, n) is getattr(importlib.import_module(meshlm._HOME[n]), n, None)\n"
        "           or getattr(meshlm, n) is importlib.import_module(meshlm._HOME[n]))\n"
        "       for n in meshlm.__all__ if n in meshlm._HOME}\n"
        "try:\n"
        "    meshlm.no_such_name\n"
        "    res['missing'] = False\n"
        "except AttributeError as e:\n"
        "    res['missing'] = 'no_such_name' in str(e)\n"
        "res['all'] = set(meshlm.__all__) <= set(meshlm._HOME)\n"
        "res['dir'] = set(meshlm.__all__) <= set(dir(meshlm))\n"
        "print(json.dumps(res))"
    )
    res = json.loads(out)
    assert res and all(res.values()), {k: v for k, v in res.items() if not v}


@pytest.mark.parametrize(
    "mesh,starts",
    [
        ({"dp": 2}, True),
        ({"fsdp": 2, "tp": 2}, True),
        ({"dp": 1}, False),
        ({"dp": -1, "tp": 2}, False),
        ({"dp": 4, "fsdp": 8, "tp": 8}, False),  # more workers than one machine can start: launch refuses it
    ],
)
def test_prestart_starts_the_forkserver_of_a_multi_process_mesh(mesh, starts):
    """A mesh of more than one process gets its forkserver (with OMP_NUM_THREADS set for
    its workers, then restored here); one device, a ``-1`` axis, or more processes than
    this machine can start (NOTE [local process limit]) gets none; a second call reuses
    the server."""
    out = _python(
        "import json, os, multiprocessing.forkserver as fs\n"
        "from meshlm.app.launch import prestart\n"
        f"prestart({mesh!r})\n"
        "pid = fs._forkserver._forkserver_pid\n"
        f"prestart({mesh!r})\n"
        "print(json.dumps([pid, fs._forkserver._forkserver_pid, 'OMP_NUM_THREADS' in os.environ]))"
    )
    first, second, omp_left = json.loads(out)
    assert (first is not None) == starts and second == first and not omp_left


def test_a_mesh_too_large_for_this_machine_is_refused_before_any_process_starts(monkeypatch, tmp_path):
    """256 ranks on one machine (the fork server takes at most 125 workers; NOTE [local
    process limit] in meshlm/app/launch.py): one MeshError naming the mesh, the size and the
    limit, and pointing at ``meshlm plan`` and torchrun, before the launcher runs."""
    import torch.distributed.launcher.api as launcher_api

    from meshlm.app.config import load_config
    from meshlm.app.launch import launch, local_limit
    from meshlm.core.errors import MeshError

    def started(*a, **k):
        raise AssertionError("the launcher started workers")

    monkeypatch.setattr(launcher_api, "elastic_launch", started)
    monkeypatch.delenv("MESHLM_START_METHOD", raising=False)
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(["model=llama_tiny", "mesh=dp4_fsdp8_tp8", "layout=fsdp_tp", "train.batch_size=256"])
    limit, _why = local_limit("forkserver")
    assert limit <= 125  # the fork server's cap, if nothing lower binds
    with pytest.raises(MeshError) as e:
        launch(cfg, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "mesh dp=4,fsdp=8,tp=8 needs 256 worker processes" in msg, msg
    assert f"at most {limit}" in msg and "meshlm plan" in msg and "torchrun across nodes" in msg, msg
