"""A resumed run's tracker (NOTE [experiment tracking] in meshlm/app/tracking.py) continues the
same run and logs no step twice: the stopped run logged steps 1-4 past its checkpoint of step
2; the resume runs steps 3-6 again and only 5-6 reach the tracker.  Read back with
tensorboard's own event reader.  And a missing library fails naming its extra."""

from __future__ import annotations

import glob
import importlib.util

import pytest

from meshlm.app.config import load_config
from meshlm.core.errors import ConfigError


def _log(cfg, run_dir, steps):
    from meshlm.app.tracking import Tracker

    tr = Tracker(cfg, run_dir, "20261207-000000-abcdef", "fsdp (runs as: ZeRO-3 over fsdp=2)")
    for s in steps:
        tr.log({"step": s, "loss": 10.0 - s, "lr": 0.1})
    tr.close()


def test_resume_logs_no_step_twice(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(["logger=tensorboard", f"checkpoint.dir={tmp_path / 'ck'}"])
    _log(cfg, tmp_path / "a", range(1, 5))
    _log(cfg, tmp_path / "b", range(3, 7))
    (logdir,) = glob.glob(str(tmp_path / "ck" / "tensorboard" / "*"))
    ea = EventAccumulator(logdir, size_guidance={"scalars": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("loss")] == [(s, 10.0 - s) for s in range(1, 7)]


def test_another_run_starts_its_own_axis(tmp_path):
    from meshlm.app.tracking import Tracker

    cfg = load_config(["logger=tensorboard", f"logger.dir={tmp_path}"])
    for _ in range(2):  # no checkpoints: each run is new, in a directory of its own
        tr = Tracker(cfg, tmp_path / "run", None, "single")
        tr.log({"step": 1, "loss": 1.0})
        tr.close()
    assert len(glob.glob(str(tmp_path / "tensorboard" / "*"))) == 2


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_missing_library_names_the_extra(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))
    with pytest.raises(ConfigError, match=rf"logger={name} needs the '{name}' package.*pip install 'meshlm\[{name}\]'"):
        load_config([f"logger=[{name}]"])
