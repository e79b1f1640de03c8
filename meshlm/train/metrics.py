"""Per-step measurements and the run's metrics files: peak memory, ``metrics.jsonl``,
the loss-curve PNG and a sweep's summary table and plot.  (Collective bytes: meshlm.runtime.comm.)"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: CUDA allocator's max allocated bytes on GPU,
    resident set size high-water mark (``ru_maxrss``) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class StepMemory:
    """One training step's tensor memory on this rank, by kind (NOTE [run memory]).

    NOTE [run memory]
        ``meshlm train`` measures one step (the second it runs; the first is warm-up) and
        reports, per rank and for the fullest rank: ``params``, ``grads`` (after the
        backward of the last micro-batch: ``.grad``, main gradients, the masters'
        gradients) and ``optimizer`` (masters that are not a parameter's own storage, and
        the optimizer's state, after the step), each storage counted once
        (:func:`meshlm.runtime.memory.model_state_bytes`), and ``peak``: the most tensor memory
        live at once during the step, model state included (activations, gathered
        parameters, reduction buffers).  On CUDA the peak is the allocator's
        (``max_memory_allocated``); on CPU it is the tracked tensor storage
        (:class:`meshlm.runtime.memory.PeakStorage`, eager only: under ``torch.compile`` on CPU
        it is not measured; a collective buffer that gloo's thread frees late may be in
        it, NOTE [storage the backend frees] in meshlm/runtime/memory.py).  Neither is the
        process's resident set, which the runtime dominates on small runs and which is
        reported separately as RSS.  The measured
        step is left out of tokens/s (the tracking slows it)."""

    def __init__(self, model, opt, device: torch.device, track_peak: bool = True):
        self.model, self.opt, self.device, self.track = model, opt, device, track_peak
        self.grads = 0
        self.backend_slack = 0  # NOTE [storage the backend frees] in meshlm/runtime/memory.py
        self.mode = None
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "StepMemory":
        from meshlm.runtime.memory import PeakStorage

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.track:
            state = (
                list(self.model.parameters())
                + list(getattr(self.opt, "masters", dict)().values())
                + [
                    v
                    for s in getattr(self.opt, "inner", self.opt).state.values()
                    for v in s.values()
                    if torch.is_tensor(v)
                ]
            )
            self.mode = PeakStorage(state)
            self.mode.__enter__()
        return self

    def after_backward(self) -> None:
        from meshlm.runtime.memory import model_state_bytes

        self.grads = model_state_bytes(self.model, self.opt)["grads"]

    def __exit__(self, *exc) -> None:
        from meshlm.runtime.memory import model_state_bytes

        peak = None
        if self.mode is not None:
            self.mode.__exit__(*exc)
            peak = self.mode.peak
            self.backend_slack = self.mode.backend_slack
        elif self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        state = model_state_bytes(self.model, self.opt)
        self.result = {"params": state["params"], "grads": self.grads, "optimizer": state["optimizer"], "peak": peak}


class MetricsWriter:
    """``metrics.jsonl`` in the run directory: one JSON object per line (rank 0 only)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self._f.close()


def read_metrics(path: "str | os.PathLike") -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(rows: list[dict[str, Any]], path: "str | os.PathLike", title: str = "") -> None:
    """A loss-curve PNG: train loss per step, validation loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
