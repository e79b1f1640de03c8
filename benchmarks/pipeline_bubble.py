"""Measured pipeline bubble of each schedule against its formula, on 4 CPU ranks.

    python benchmarks/pipeline_bubble.py [--pp 4] [--microbatches 8] [--forward-ms 40]
                                         [--backward-ms 80] [--steps 3] [--out DIR]

A model of ``2 * pp`` blocks, each of whose forward sleeps ``forward-ms / 2`` and backward
``backward-ms / 2`` (half on the path to its input, half on the path to its weight, so that
the zero-bubble schedules have weight-gradient work to move into the bubble), is pipelined
by meshlm under layout ``pp`` on ``--pp`` gloo ranks: each stage then spends ``forward-ms``
and ``backward-ms`` per micro-batch (two blocks, or two stages of one block with
``stages_per_rank=2``).  Sleeping, the stages take no CPU, so four ranks on two cores give
clean timings.  For each schedule, after a warm-up step, ``--steps`` steps are timed (a
barrier before each; the step's time is the slowest rank's) and the bubble is

    idle fraction = 1 - m * (F + B) / T

(m micro-batches, F and B a stage's forward and backward per micro-batch on one rank, T
the step time: "of the padded work"), and ``1 - busy / T`` with busy the time the rank
measured in its stages' forwards and in autograd (the padding plus meshlm's and torch's
own work per micro-batch: "of the measured work", the mean over ranks), the medians over
the steps, next to the schedule's formula (NOTE
[schedules] in meshlm/runtime/pipeline/schedule.py): GPipe and 1F1B (p-1)/(m+p-1), interleaved
(p-1)/(v*m+p-1); the zero-bubble schedules have no closed form here and are compared with
interleaved.  Writes DIR/bubble.json and DIR/bubble.md (default
benchmarks/results/pipeline_bubble/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import meshlm

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2)]


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd`` seconds and backward ``bwd``."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd)
        return g, None, None


@meshlm.block
class SleepBlock(nn.Module):
    param_axes = {"w": ("embed",)}

    def __init__(self, width: int, fwd: float, bwd: float, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(width, device=device))
        self.fwd, self.bwd = fwd, bwd

    def init_weights(self, gen):
        nn.init.normal_(self.w, mean=1.0, std=0.01, generator=gen)

    def forward(self, x):  # the input's gradient path and the weight's each sleep half the backward
        x = _Sleep.apply(x, self.fwd, self.bwd / 2)
        return x * _Sleep.apply(self.w, 0.0, self.bwd / 2)


class SleepModel(nn.Module):
    param_axes = {"emb": ("vocab", "embed")}

    def __init__(self, blocks: int, fwd: float, bwd: float, width: int = 16, device=None):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(8, width, device=device))
        self.blocks = nn.ModuleList(SleepBlock(width, fwd, bwd, device) for _ in range(blocks))

    def init_weights(self, gen):
        nn.init.normal_(self.emb, std=0.02, generator=gen)

    def forward(self, tokens, targets):
        h = meshlm.constrain(self.emb[tokens], ("batch", "seq", "embed"))
        for b in self.blocks:
            h = b(h)
        return meshlm.reduce_batch((h.float().mean(-1) - targets.float()).square().mean(), "mean")


class _Busy:
    """The seconds this rank spends in its stages' forwards and in autograd (their
    backwards, the input- and weight-gradient halves of the zero-bubble ones included)."""

    def __enter__(self):
        from meshlm.runtime.pipeline.stage import StageModule

        self.seconds = 0.0
        self.saved = (StageModule.forward, torch.autograd.backward, torch.autograd.grad)

        def timed(fn):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            return run

        StageModule.forward = timed(self.saved[0])
        torch.autograd.backward, torch.autograd.grad = timed(self.saved[1]), timed(self.saved[2])
        return self

    def __exit__(self, *exc):
        from meshlm.runtime.pipeline.stage import StageModule

        StageModule.forward, torch.autograd.backward, torch.autograd.grad = self.saved


def _measure(pp: int, m: int, fwd_ms: float, bwd_ms: float, steps: int) -> list[dict]:
    import torch.distributed as dist

    from meshlm.runtime.pipeline import bubble, build_pipeline, pipeline_mesh

    out = []
    for name, v in SCHEDULES:
        n_blocks = 2 * pp  # every rank holds two blocks: one stage of two, or two stages of one
        fwd, bwd = fwd_ms / 1e3 / 2, bwd_ms / 1e3 / 2
        mesh, sub = pipeline_mesh({"pp": pp})
        x = torch.zeros(m * 2, 4, dtype=torch.long)
        ex = ((x[:2], x[:2]), {})
        pipe = build_pipeline(
            lambda d: SleepModel(n_blocks, fwd, bwd, device=d),
            "pp",
            mesh,
            sub,
            example=ex,
            microbatches=m,
            schedule=name,
            stages_per_rank=v,
            split=[2 // v] * (pp * v),  # the same work on every rank (the embedding weighs nothing here)
        )
        inputs = [((x[2 * i : 2 * i + 2], x[2 * i : 2 * i + 2]), {}) for i in range(m)]
        pipe.step(inputs)  # warm-up
        times, idle = [], []
        for _ in range(steps):
            dist.barrier()
            with _Busy() as busy:
                t0 = time.perf_counter()
                pipe.step(inputs)
                t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
            idle.append(1 - busy.seconds / float(t))
        T = statistics.median(times)
        mean_idle = torch.tensor([statistics.median(idle)])
        dist.all_reduce(mean_idle)
        out.append(
            {
                "schedule": name,
                "stages_per_rank": v,
                "step_s": T,
                "idle": 1 - m * (fwd_ms + bwd_ms) / 1e3 / T,
                "idle_busy": float(mean_idle) / dist.get_world_size(),
                "formula": bubble(name, pp, m, v) if name in ("gpipe", "1f1b", "interleaved_1f1b") else None,
            }
        )
    return out


def write_report(rows, args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bubble.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Pipeline bubble, {args.pp} ranks, {args.microbatches} micro-batches, a stage {args.forward_ms:g} ms "
        f"forward + {args.backward_ms:g} ms backward per micro-batch",
        "",
        f"`python benchmarks/pipeline_bubble.py --pp {args.pp} --microbatches {args.microbatches} --forward-ms "
        f"{args.forward_ms:g} --backward-ms {args.backward_ms:g} --steps {args.steps}` (median of {args.steps} steps)",
        "",
        "| schedule | stages per rank | step (s) | idle, of the padded work | idle, of the measured work | formula |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = f"{r['formula']:.3f}" if r["formula"] is not None else "below interleaved"
        lines.append(
            f"| {r['schedule']} | {r['stages_per_rank']} | {r['step_s']:.3f} | {r['idle']:.3f} | "
            f"{r['idle_busy']:.3f} | {f} |"
        )
    (out / "bubble.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="pipeline bubble per schedule")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--forward-ms", type=float, default=40.0)
    ap.add_argument("--backward-ms", type=float, default=80.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_bubble"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the multi-process harness
    from harness import DistPool

    with DistPool(args.pp, timeout_s=120, job_timeout_s=900) as pool:
        rows = pool.run(_measure, args.pp, args.microbatches, args.forward_ms, args.backward_ms, args.steps)[0]
    write_report(rows, args, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
