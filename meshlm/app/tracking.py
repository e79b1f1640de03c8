"""Experiment tracking: TensorBoard, Weights & Biases and MLflow, from rank 0 of ``meshlm train``.

NOTE [experiment tracking]
    ``logger=tensorboard`` (or ``wandb``, ``mlflow``; several at once: ``logger=[tensorboard,
    wandb]``) sends what ``metrics.jsonl`` holds to the chosen trackers, from rank 0 only:
    the resolved config (once), and per logged step ``loss``, ``lr``, ``grad_norm``,
    ``tokens_per_s`` and ``step_time_s``, ``val_loss`` where measured, the memory of every
    rank at the measured step (``memory/rank<R>/<kind>_bytes``, gathered from all ranks:
    NOTE [run memory] in meshlm/train/metrics.py) and the effective layout (NOTE [effective
    sharding] in meshlm/layout/effective.py) as text, tag or config entry.  The libraries are
    optional extras (``pip install 'meshlm[tensorboard]'``, ``[wandb]``, ``[mlflow]``); a
    logger whose library is missing fails before any process starts, naming the extra.

    Where: ``logger.dir``, else ``checkpoint.dir`` when set (so a resume finds the run it
    continues), else the run directory.  There ``tracking.json`` records the run id (the
    checkpoints' run id, NOTE [one run per checkpoint directory]), each tracker's own id of
    the run and the last step logged.  A resumed run of the same id continues the same
    tracker run on the same step axis: TensorBoard's event files in ``<dir>/tensorboard/<run id>``,
    the W&B run of the same id (``resume="allow"``), the MLflow run recorded.  Steps at or
    below the last one logged are not logged again: a run stopped after step 7 with its last
    checkpoint at step 5 logged steps 6 and 7 already, and the resume's own steps 6 and 7
    (the same values: a resume continues exactly) are skipped, so no step appears twice.

    Offline: TensorBoard writes files only; ``logger.wandb_mode=offline`` keeps the W&B run
    in ``<dir>/wandb`` for ``wandb sync``; MLflow's default store is the local directory
    ``<dir>/mlruns`` (``mlflow ui --backend-store-uri <dir>/mlruns``; MLflow 3 keeps such a
    file store in maintenance mode and needs ``MLFLOW_ALLOW_FILE_STORE=true``, which meshlm
    sets for a local store), or ``logger.mlflow_uri`` (a server, a database).  A sweep's
    runs share a group (``logger.group``; the sweep directory by default): W&B's group,
    an MLflow tag, and for TensorBoard the sweep directory as the log directory of them all.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from meshlm.core.errors import ConfigError

#: logger -> (the module it imports, the meshlm extra that installs it)
BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
STATE = "tracking.json"
STEP_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "loss_scale")


def chosen(lc) -> list[str]:
    """The loggers ``lc`` (the ``logger`` config section) turns on."""
    return [n for n in BACKENDS if getattr(lc, n)]


def check_loggers(lc) -> None:
    """Each chosen logger's library is importable (a lookup, no import); else a ConfigError
    naming the extra that installs it."""
    for name in chosen(lc):
        module, extra = BACKENDS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"logger={name} needs the {module!r} package, which is not installed; install it with: "
                f"pip install 'meshlm[{extra}]' (or drop {name} from logger=...)"
            )
    if lc.wandb_mode not in (None, "online", "offline", "disabled"):
        raise ConfigError(f"logger.wandb_mode={lc.wandb_mode!r}: choose online, offline or disabled (null: W&B's own)")


def tracking_dir(cfg, run_dir: Path) -> Path:
    """Where the trackers write (NOTE [experiment tracking])."""
    return Path(cfg.logger.dir or cfg.checkpoint.dir or run_dir)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


class _TensorBoard:
    def __init__(self, root: Path, run_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(root / "tensorboard" / run_id))

    def start(self, config: dict, config_text: str, layout: str, state: dict) -> None:
        if not state.get("tensorboard_started"):
            self.w.add_text("config", "```yaml\n" + config_text + "\n```", 0)
            self.w.add_text("layout_effective", layout, 0)
            state["tensorboard_started"] = True

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()  # a crash loses no logged step

    def close(self) -> None:
        self.w.close()


class _WandB:
    def __init__(self, root: Path, group: Optional[str]):
        self.root, self.group, self.run = root, group, None

    def start(self, config: dict, config_text: str, layout: str, state: dict, *, project: str, mode, run_id: str):
        import wandb

        rid = state.setdefault("wandb_id", run_id.replace(":", "-"))
        self.run = wandb.init(
            project=project,
            dir=str(self.root),
            id=rid,
            resume="allow",
            group=self.group,
            name=run_id,
            mode=mode,
            config={**config, "layout_effective": layout},
            settings=wandb.Settings(silent=True, console="off"),
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class _MLflow:
    def __init__(self, root: Path, group: Optional[str], uri: Optional[str]):
        self.uri = uri or (root / "mlruns").resolve().as_uri()
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # NOTE [experiment tracking]
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.group, self.run_id = group, None

    def start(self, config: dict, config_text: str, layout: str, state: dict, *, project: str, run_id: str):
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = state.get("mlflow_run_id")
        if self.run_id is None:
            tags = {"meshlm.run_id": run_id, "layout_effective": layout}
            if self.group:
                tags["meshlm.group"] = self.group
            run = self.client.create_run(exp_id, run_name=run_id, tags=tags)
            self.run_id = state["mlflow_run_id"] = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_text(self.run_id, config_text, "config.yaml")
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)


class Tracker:
    """Rank 0's fan-out of a run's metrics to the chosen trackers (NOTE [experiment tracking])."""

    def __init__(self, cfg, run_dir: Path, run_id: Optional[str], layout: str):
        lc = cfg.logger
        self.root = tracking_dir(cfg, run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / STATE
        state = json.loads(path.read_text()) if path.exists() else {}
        if run_id is None:  # no checkpoints, so no resume: a run of its own
            from meshlm.train.checkpoint.runs import new_run_id

            run_id = new_run_id()
        rid = run_id
        if state.get("run_id") != rid:  # another run: its own tracker runs and step axis
            state = {"run_id": rid}
        self.state, self.path = state, path
        self.last = int(state.get("last_step", 0))
        config = cfg.to_dict()
        import yaml

        text = yaml.safe_dump(config, sort_keys=False)
        self.backends: list[Any] = []
        for name in chosen(lc):
            if name == "tensorboard":
                b = _TensorBoard(self.root, rid)
                b.start(config, text, layout, state)
            elif name == "wandb":
                b = _WandB(self.root, lc.group)
                b.start(config, text, layout, state, project=lc.project, mode=lc.wandb_mode, run_id=rid)
            else:
                b = _MLflow(self.root, lc.group, lc.mlflow_uri)
                b.start(config, text, layout, state, project=lc.project, run_id=rid)
            self.backends.append(b)
        self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.path)

    def log(self, row: dict[str, Any], memory: Optional[list[dict]] = None) -> None:
        """One ``metrics.jsonl`` row (and, at the measured step, every rank's memory)."""
        step = int(row["step"])
        if step <= self.last:  # logged by the run this one resumes (NOTE [experiment tracking])
            return
        metrics = {k: float(row[k]) for k in STEP_KEYS if isinstance(row.get(k), (int, float))}
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for r, kinds in enumerate(memory or []):
            metrics.update({f"memory/rank{r}/{k}_bytes": float(v) for k, v in kinds.items() if v is not None})
        for b in self.backends:
            b.log(metrics, step)
        self.last = self.state["last_step"] = step
        self._save()

    def close(self) -> None:
        for b in self.backends:
            b.close()
