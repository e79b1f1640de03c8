"""What a training run does around its steps: resume, save, stop on a signal, report.

``meshlm.app.train.run`` owns the model, data and optimizer; it hands them to a :class:`Lifecycle`
that resumes from a checkpoint (``resume``), saves after a step and stops the loop when the
job is asked to (``after_step``), and writes the lines that say what happened.

NOTE [stopping on a signal]
    SIGTERM (what SLURM and Kubernetes send before a kill) and SIGINT (Ctrl-C) only set a
    flag.  The step in progress finishes; after it every rank takes part in one all-reduce
    of the flags, so all ranks stop after the *same* step even when the signal reached them
    at different times (or reached only one of them).  Then, if ``checkpoint.dir`` is set,
    the run saves that step (unless it was just saved), rank 0 prints one line naming the
    signal, the step and the checkpoint, and the process exits with status 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT): the status a shell, SLURM or Kubernetes reads
    as "terminated by that signal".  A second signal more than ``REPEAT_S`` (3 s) after the
    first stops the process at once, without saving.  The saved step is a step boundary, so a
    resume continues the loss curve exactly (tests/dist/test_preemption.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from meshlm.core.errors import ConfigError

log = logging.getLogger("meshlm.app.train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A repeat of the signal sooner than this is the same request (Ctrl-C reaches a worker from
# the terminal and again from the launcher passing it on); later, it means "stop now".
REPEAT_S = 3.0


def resume_path(cfg) -> Optional[str]:
    """The checkpoint directory this run resumes from, or None (local read, no collective)."""
    from meshlm.train.checkpoint import list_checkpoints, resolve_path, verify_checkpoint

    r = cfg.checkpoint.resume
    if r is None:
        return None
    if r == "auto":  # the newest whose files are all there (the resume checks their CRC-32s too)
        for _step, path in reversed(list_checkpoints(cfg.checkpoint.dir) if cfg.checkpoint.dir else []):
            if verify_checkpoint(path, crc=False) is None:
                return path
        return None
    return resolve_path(str(r))


def lock_checkpoint_dir(cfg, run_dir) -> Any:
    """Take ``checkpoint.dir``'s lock before anything reads or writes it (collective; NOTE
    [one writer per checkpoint directory] in meshlm/train/checkpoint/lock.py): rank 0's hold, or None
    (another rank, or no checkpoint.dir).  A second run into the directory stops here."""
    if not cfg.checkpoint.dir:
        return None
    from meshlm.train.checkpoint import lock_dir

    lock = lock_dir(cfg.checkpoint.dir, str(run_dir))
    note = lock.took_over_line() if lock is not None else None
    if note:
        log.warning(note)
        print(f"meshlm train: {note}", flush=True)
    return lock


# The shipped reference models, by the class name a checkpoint's meta.json records
_REFERENCE_TARGETS = {"Llama": "meshlm.models.llama_model", "GPT2": "meshlm.models.gpt2_model"}


_UNSET = object()


def _field_defaults(target: str) -> dict:
    """The defaults of the config fields of a shipped reference model (``_REFERENCE_TARGETS``)."""

    from meshlm.models.gpt2 import GPT2Config
    from meshlm.models.llama import LlamaConfig

    cls = {"meshlm.models.llama_model": LlamaConfig, "meshlm.models.gpt2_model": GPT2Config}[target]
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def model_config(cfg, mcfg):
    """The model node to build: for a run that resumes a checkpoint of a shipped reference
    model (Llama, GPT-2), that model with the architecture saved in the checkpoint, so a
    resumed model has the saved shapes and resuming a checkpoint of ``meshlm convert``
    needs only its directory; else ``mcfg``.  A node naming a model of one's own
    (``model._target_``) is kept as given.  ``dropout`` is a training setting, not part of
    the weights: this run's value stays."""
    path = resume_path(cfg)
    if path is None or mcfg.target not in _REFERENCE_TARGETS.values():
        return mcfg
    from meshlm.train.checkpoint import read_meta

    try:
        info = read_meta(path).get("model", {})
    except Exception:  # noqa: BLE001 - the load reports a bad checkpoint, on every rank at once
        return mcfg
    target = _REFERENCE_TARGETS.get(info.get("class"))
    saved = {k: v for k, v in dict(info.get("config") or {}).items() if k not in ("dropout", "name")}
    if target is None or not saved:
        return mcfg
    args = {k: v for k, v in mcfg.args.items() if k == "dropout"} if target != mcfg.target else dict(mcfg.args)
    defaults = _field_defaults(target)  # a field the node leaves out has its default
    changed = {k: v for k, v in saved.items() if args.get(k, defaults.get(k, _UNSET)) != v}
    if target == mcfg.target and not changed:
        return mcfg
    args.update(saved)
    new = dataclasses.replace(mcfg, target=target, args=args)
    diff = ", ".join([f"_target_={target}"] * (target != mcfg.target) + [f"{k}={v}" for k, v in changed.items()])
    log.info("model config taken from checkpoint %s (%s)", path, diff)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"meshlm train: model config from the checkpoint resumed ({path}): {diff}", flush=True)
    return new


def _where(layout: Any, mesh: Any, world: Any) -> str:
    return f"layout {layout}, mesh {mesh} ({world} rank{'' if world == 1 else 's'})"


def _mesh_str(sizes: Optional[dict]) -> str:
    """``fsdp=2,tp=2``: the axes of size > 1 (one process: the first axis), as configs print."""
    if not sizes:
        return "?"
    act = [f"{a}={s}" for a, s in sizes.items() if s > 1]
    return ",".join(act) or f"{next(iter(sizes))}=1"


class Lifecycle:
    """Resume, save and stop for one run (every rank makes one; collective methods are
    called by all ranks alike)."""

    def __init__(
        self,
        cfg,
        *,
        model,
        optimizer,
        mesh,
        layout_label: str,
        mesh_label: str,
        device: torch.device,
        say: Callable[[str], None] = print,
        lock: Any = None,
        run_dir: Optional[str] = None,
    ):
        self.cfg = cfg
        self.model, self.optimizer, self.mesh = model, optimizer, mesh
        self.now = _where(layout_label, mesh_label, dist.get_world_size() if dist.is_initialized() else 1)
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.say = say  # rank 0's stdout (the progress bar's write while it runs)
        self.ckpt = None
        self.start = 0
        self.last_saved_step: Optional[int] = None
        self.stop_signal: Optional[int] = None
        self._got: Optional[int] = None
        self._got_at = 0.0
        self._old: dict[int, Any] = {}
        self.lock = lock  # rank 0's hold on checkpoint.dir (lock_checkpoint_dir), released by close()
        self.run_dir = run_dir

    # ------------------------------------------------------------------ resume
    def resume(self, loader, scaler) -> int:
        """Open the checkpointer, load the checkpoint to resume from (if any) into the
        model, optimizer, ``loader`` and ``scaler``; return the global step to start after."""
        c = self.cfg.checkpoint
        if not (c.dir or c.resume):
            return 0
        try:
            from meshlm.train.checkpoint import Checkpointer
        except ImportError as e:
            raise ConfigError(
                f"checkpoint.dir/checkpoint.resume are set but meshlm.train.checkpoint is unavailable ({e}); "
                "set checkpoint.dir=null"
            ) from None
        self.ckpt = Checkpointer(
            c,
            model=self.model,
            optimizer=self.optimizer,
            mesh=self.mesh,
            run_meta={"config": self.cfg.to_dict()},
            say=self._line,
            run_dir=self.run_dir,
        )
        extra = self.ckpt.resume()
        rid = self.ckpt.run_id
        if extra is None:
            if c.dir:
                self._line(f"checkpoints: run {rid} in {c.dir}" + (" (none to resume yet)" if c.resume else ""))
            return 0
        self.start = int(extra["step"])
        if "loader" in extra:  # none in a checkpoint of meshlm convert (step 0)
            loader.load_state_dict(extra["loader"])
        if scaler is not None and "loss_scaler" in extra:
            scaler.load_state_dict(extra["loss_scaler"])
        meta = self.ckpt.resumed or {}
        lay = (meta.get("model", {}).get("layout") or {}).get("name") or "?"
        then = _where(lay, _mesh_str(meta.get("model", {}).get("mesh")), meta.get("world_size", "?"))
        self._line(
            f"resumed from step {self.start} ({meta.get('path')}, run {rid}): saved under {then}; now {self.now}"
        )
        return self.start

    @property
    def stop_name(self) -> Optional[str]:
        """``SIGTERM``/``SIGINT`` when the run stopped on a signal, else None."""
        return signal.Signals(self.stop_signal).name if self.stop_signal else None

    @property
    def run_id(self) -> Optional[str]:
        return self.ckpt.run_id if self.ckpt is not None else None

    def _line(self, msg: str) -> None:
        log.info(msg)
        if self.rank == 0:
            self.say(f"meshlm train: {msg}")

    # ------------------------------------------------------------------ save / stop
    def _save(self, step: int, state: dict, why: str) -> None:
        assert self.ckpt is not None
        path = self.ckpt.save(step, state)
        self.last_saved_step = step
        self._line(f"saved step {step}{why}: {path} (run {self.ckpt.run_id}; {self.now})")

    def after_step(self, step: int, state: Callable[[], dict]) -> bool:
        """After global step ``step``: save if ``checkpoint.every`` says so, or at the last
        step (whenever ``checkpoint.dir`` is set); True when the job was asked to stop (NOTE [stopping on a signal]; it has then saved)."""
        c = self.cfg.checkpoint
        if self.ckpt is not None and c.dir and c.every > 0 and step % c.every == 0:
            self._save(step, state(), "")
        elif self.ckpt is not None and c.dir and step == self.cfg.train.steps:
            self._save(step, state(), " (the last step)")
        self.stop_signal = self._agree_stop()
        if self.stop_signal is None:
            return False
        name = signal.Signals(self.stop_signal).name
        if self.ckpt is not None and c.dir and self.last_saved_step != step:
            self._save(step, state(), f" (stopping on {name})")
        return True

    def _agree_stop(self) -> Optional[int]:
        got = self._got or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            t = torch.tensor([got], dtype=torch.int32, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            got = int(t.item())
        return got or None

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT set the stop flag (main thread only; elsewhere a no-op)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for s in STOP_SIGNALS:
            self._old[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self._got is not None and time.monotonic() - self._got_at > REPEAT_S:
            # a second request: stop now (the launcher's own forward of the first arrives sooner)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._got is None:
            self._got, self._got_at = signum, time.monotonic()
            log.warning("got %s: stopping after the current step", signal.Signals(signum).name)

    def restore_signal_handlers(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def close(self, handlers: bool = True) -> None:
        """Release the checkpointer and the lock; ``handlers``: restore the signal handlers too."""
        if handlers:
            self.restore_signal_handlers()
        if self.ckpt is not None:
            self.ckpt.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------ lines
    def steps_line(self, last: int, total: int) -> str:
        """``N steps (this process; global steps a-b of T)``."""
        ran = last - self.start
        span = f"global steps {self.start + 1}-{last}" if ran > 0 else f"global step {last}"
        return f"{ran} steps (this process; {span} of {total})"

    def stopped_line(self, step: int) -> str:
        name = signal.Signals(self.stop_signal or signal.SIGTERM).name
        c = self.cfg.checkpoint
        if self.ckpt is not None and c.dir:
            saved = (
                f"checkpoint {self.ckpt.last_saved} (run {self.ckpt.run_id}); continue with "
                f"checkpoint.dir={c.dir} checkpoint.resume=auto"
            )
        else:
            saved = "no checkpoint saved (checkpoint.dir is not set)"
        return (
            f"stopped by {name} after {self.steps_line(step, self.cfg.train.steps)}; {saved}; "
            f"exit status {exit_status(self.stop_signal)}"
        )


def exit_status(signum: Optional[int]) -> int:
    """128 + the signal number: what a shell reports for a process the signal ended."""
    return 128 + int(signum or signal.SIGTERM)


def nothing_to_do(start: int, steps: int, life: Lifecycle) -> str:
    """The line of a run resumed at (or past) its last step."""
    rid = f", run {life.run_id}" if life.run_id else ""
    return (
        f"nothing to do: the checkpoint resumed is at step {start}{rid} and train.steps={steps}; "
        f"raise train.steps to train further"
    )


class StartupClock:
    """Where a run's start-up goes, in seconds (summary.json ``startup_s``): ``launch``, from
    ``meshlm.app.launch`` starting the job to this worker entering ``train.run`` (rendezvous,
    process spawn, imports; absent under torchrun); ``process_group`` (joining it, the
    mesh); ``build`` (model, layout, optimizer, data, resume); ``first_step`` (the first
    step, compilation included)."""

    def __init__(self) -> None:
        self.t0 = float(os.environ.get(LAUNCH_T0, "nan"))
        self.marks = [("run", time.time())]

    def mark(self, name: str) -> None:
        if name not in dict(self.marks):
            self.marks.append((name, time.time()))

    def result(self) -> dict[str, float]:
        out = {} if self.t0 != self.t0 else {"launch": round(self.marks[0][1] - self.t0, 3)}
        for (_a, ta), (b, tb) in zip(self.marks, self.marks[1:]):
            out[b] = round(tb - ta, 3)
        return out


LAUNCH_T0 = "MESHLM_LAUNCH_T0"  #: set by meshlm.app.launch: the wall-clock time the job started
