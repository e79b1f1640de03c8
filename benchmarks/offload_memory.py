"""Optimizer state on disk: peak memory, a memory cap, and what an offloaded step costs.

    python benchmarks/offload_memory.py [--layers 24] [--embed 768] [--mlp 2048] [--steps 4]
                                        [--out benchmarks/results/offload]

The same `meshlm train` run (one process, layout=single, a byte-level Llama of `--layers`
blocks, fp32 AdamW, 4 steps), one after the other on the same machine: without offload,
with `offload.optimizer=disk`, with `offload.optimizer=disk offload.params=disk`, and with
`offload.grads=disk` added; every
run with torch's fused AdamW (`train.optimizer_impl=fused`, what `auto` picks for an
offloaded step on the CPU), and the offloaded one again with the for-loop AdamW (torch's
default on the CPU) for the step's arithmetic.  From each run's summary.json and
metrics.jsonl:

- peak RSS (the process's resident high-water mark, ru_maxrss): the offloaded run's must be
  lower by the optimizer bytes `meshlm plan` predicts for the run without offload (its
  `planned_optimizer_bytes`: AdamW's exp_avg and exp_avg_sq), within 10%.  What is left in
  memory of them is one chunk's state at a time (one block, NOTE [offloaded step]).  A run
  with a disk tier has glibc map allocations of 1 MiB and more on their own
  (meshlm.runtime.offload.runtime.return_freed_memory), so that freed storages leave the RSS.
- a memory cap: both runs again, each in a cgroup (v1 memory controller, as a SLURM job's
  memory limit) whose limit lies halfway between the two peaks.  The run without offload
  needs more than the cap and is killed by the kernel's OOM killer; the offloaded run trains
  within it.  Needs root and a writable /sys/fs/cgroup/memory; skipped (and said) otherwise.
- the step: time per step of each run (the mean of the steps after the first), and of the
  offloaded ones their parts: moving the state between memory and disk (`transfer`) and the
  optimizer's arithmetic (`step`), from the run's offload_optimizer_transfer_s and
  offload_optimizer_step_s, and moving the gradients (offload_grads_transfer_s), each per
  step, over all steps.

Writes <out>/offload_memory.json and .md.  Figures are for this machine only: the disk tier's
speed is the page cache's and the disk's, and 2 cores run the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
CGROUP = Path("/sys/fs/cgroup/memory")
BOTH = ["offload.optimizer=disk", "offload.params=disk"]
ALL = [*BOTH, "offload.grads=disk"]


def _run(args, run_dir: Path, extra: list[str], cgroup: "Path | None" = None) -> dict:
    cmd = [sys.executable, "-m", "meshlm.app.cli", "train", *_overrides(args), *extra, f"hydra.run.dir={run_dir}"]

    def enter():  # the child, and every process it starts, counts against the cgroup's limit
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=enter, timeout=1800)
    out = {"cmd": " ".join(cmd[2:]), "returncode": r.returncode, "wall_s": time.perf_counter() - t0}
    if r.returncode != 0:
        out["stderr_tail"] = r.stderr[-600:]
        return out
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = rows[1:]  # the first step makes AdamW's state (and, offloaded, its files)
    out.update(
        rss_bytes=s["rss_bytes_per_rank"],
        planned_optimizer_bytes=s.get("planned_optimizer_bytes"),
        planned_grads_bytes=s.get("planned_grads_bytes"),
        loss=[r["loss"] for r in rows],
        step_s=sum(r["step_time_s"] for r in steady) / len(steady),
    )
    if "offload_optimizer_transfer_s" in rows[-1]:
        n = len(rows)  # cumulative figures over all steps: per step
        out["transfer_s"] = rows[-1]["offload_optimizer_transfer_s"] / n
        out["optimizer_step_s"] = rows[-1]["offload_optimizer_step_s"] / n
        out["disk_bytes"] = rows[-1]["offload_disk_bytes"]
        out["in_bytes_per_step"] = rows[-1]["offload_optimizer_in_bytes"] - rows[-2]["offload_optimizer_in_bytes"]
    if "offload_grads_transfer_s" in rows[-1]:
        out["grads_transfer_s"] = rows[-1]["offload_grads_transfer_s"] / len(rows)
    return out


def _overrides(a) -> list[str]:
    return [
        "model=llama_small",
        f"model.layers={a.layers}",
        f"model.embed={a.embed}",
        f"model.mlp={a.mlp}",
        f"model.heads={a.embed // 64}",
        f"model.kv_heads={a.embed // 128}",
        "mesh=cpu1",
        "layout=single",
        f"train.steps={a.steps}",
        "train.batch_size=2",
        "train.seq_len=64",
        "train.val_every=0",
        "train.val_batches=1",
        "train.progress=false",
        "train.count_comm=false",
        "train.optimizer_impl=fused",
    ]


def _capped(args, tmp: Path, cap: int) -> "dict | None":
    if os.geteuid() != 0 or not (CGROUP / "cgroup.procs").exists():
        return None
    cg = CGROUP / f"meshlm_offload_bench_{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(cap))
    except OSError as e:
        return {"skipped": f"cannot make a memory cgroup ({e})"}
    try:
        res = {}
        for name, extra in (("none", []), ("optimizer_params_disk", BOTH)):
            before = _oom_kills(cg)
            r = _run(args, tmp / f"capped_{name}", extra, cgroup=cg)
            r["oom_kills"] = _oom_kills(cg) - before  # the kernel's count of processes it killed in the cgroup
            r["oom_killed"] = r["returncode"] != 0 and r["oom_kills"] > 0
            res[name] = r
        return res
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass


def _oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embed", type=int, default=768)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "offload"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshlm_offload_bench_") as d:
        tmp = Path(d)
        base = _run(args, tmp / "none", [])
        off = _run(args, tmp / "optimizer_disk", ["offload.optimizer=disk"])
        both = _run(args, tmp / "optimizer_params_disk", BOTH)
        every = _run(args, tmp / "optimizer_params_grads_disk", ALL)
        loop = _run(args, tmp / "optimizer_disk_loop", ["offload.optimizer=disk", "train.optimizer_impl=for_loop"])
        for r in (base, off, both, every, loop):
            if r["returncode"] != 0:
                sys.exit(f"offload_memory: a run failed: {r['cmd']}\n{r['stderr_tail']}")
        saved = base["rss_bytes"] - off["rss_bytes"]
        planned = base["planned_optimizer_bytes"]
        cap = (base["rss_bytes"] + both["rss_bytes"]) // 2
        capped = _capped(args, tmp, cap)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/offload_memory.py " + " ".join(sys.argv[1:]),
        "runs": {
            "none": base,
            "optimizer_disk": off,
            "optimizer_params_disk": both,
            "optimizer_params_grads_disk": every,
            "optimizer_disk_for_loop": loop,
        },
        "rss_saved_bytes": saved,
        "planned_optimizer_bytes": planned,
        "saved_over_planned": saved / planned,
        "within_10pct": abs(saved / planned - 1) <= 0.10,
        "same_losses": base["loss"] == off["loss"] == both["loss"] == every["loss"],
        # what offload.grads=disk takes off the peak, against the gradients the plan counts
        "grads_rss_saved_bytes": both["rss_bytes"] - every["rss_bytes"],
        "planned_grads_bytes": base["planned_grads_bytes"],
        "cap_bytes": cap,
        "capped": capped,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "offload_memory.md").write_text(_table(result) + "\n")
    print(_table(result))


def _table(r: dict) -> str:
    runs = r["runs"]
    names = {
        "none": "no offload",
        "optimizer_disk": "offload.optimizer=disk",
        "optimizer_params_disk": "offload.optimizer=disk offload.params=disk",
        "optimizer_params_grads_disk": "offload.optimizer=disk offload.params=disk offload.grads=disk",
        "optimizer_disk_for_loop": "offload.optimizer=disk, for-loop AdamW",
    }
    lines = [
        f"`{r['command']}` ({r['date']}; {r['machine']})",
        "",
        "| run | peak RSS MiB | step s | moving optimizer state s | optimizer arithmetic s | moving gradients s |",
        "|---|---|---|---|---|---|",
    ]
    for k, label in names.items():
        x = runs[k]
        t = (f"{x['transfer_s']:.3f} | {x['optimizer_step_s']:.3f}") if "transfer_s" in x else "- | -"
        g = f"{x['grads_transfer_s']:.3f}" if "grads_transfer_s" in x else "-"
        lines.append(f"| {label} | {x['rss_bytes'] / MIB:.0f} | {x['step_s']:.3f} | {t} | {g} |")
    o = runs["optimizer_disk"]
    lines += [
        "",
        f"Losses of the four fused runs {'equal, bit for bit' if r['same_losses'] else 'DIFFER'}.  Peak RSS "
        f"saved by offload.optimizer=disk: {r['rss_saved_bytes'] / MIB:.0f} MiB; planned optimizer bytes "
        f"{r['planned_optimizer_bytes'] / MIB:.0f} MiB; ratio {r['saved_over_planned']:.3f} "
        f"({'within' if r['within_10pct'] else 'NOT within'} 10%).  On disk between steps: "
        f"{o['disk_bytes'] / MIB:.0f} MiB, read and written once a step.  Peak RSS saved by adding "
        f"offload.grads=disk: {r['grads_rss_saved_bytes'] / MIB:.0f} MiB; planned gradient bytes "
        f"{r['planned_grads_bytes'] / MIB:.0f} MiB.",
    ]
    c = r.get("capped")
    if not c:
        lines.append("Memory cap: not run (needs root and the cgroup v1 memory controller).")
    elif "skipped" in c:
        lines.append(f"Memory cap: {c['skipped']}.")
    else:

        def say(x):
            return (
                "killed by the OOM killer"
                if x["oom_killed"]
                else ("trained" if x["returncode"] == 0 else f"failed ({x['returncode']})")
            )

        lines.append(
            f"Memory cap {r['cap_bytes'] / MIB:.0f} MiB (a cgroup's memory.limit_in_bytes, halfway between the "
            f"peaks of no offload and of optimizer and params on disk): without offload {say(c['none'])}; with "
            f"offload.optimizer=disk offload.params=disk {say(c['optimizer_params_disk'])}."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
