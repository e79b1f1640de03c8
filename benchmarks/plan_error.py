"""The planner's published error (docs/plan.md, "Published error"): for every shipped model
that trains on a CPU and every shipped layout, ``meshlm plan`` (the measured method, the
default) against ``meshlm train`` on the CPU mesh, on the two figures a run reports:

- peak memory per rank (the fullest rank's storage at its peak in the measured step:
  ``mem_peak_bytes`` of summary.json, NOTE [run memory] in meshlm/train/metrics.py; the
  plan's ``memory.total``);
- bytes sent per rank per step (``comm_bytes_per_step``: every collective's ring bytes in
  the measured step; the plan's ``comm_wire_bytes_total``).

    python benchmarks/plan_error.py [--models llama_tiny,gpt2_tiny] [--layouts ddp,fsdp] [--out rows.jsonl]
    python benchmarks/plan_error.py --table rows.jsonl     # the table of rows run in parts

The rows of the table in docs/plan.md are in benchmarks/results/plan_error.jsonl.

Each row runs ``meshlm plan`` and a 3-step ``meshlm train`` (global batch 8 x seq 32,
``train.grad_clip=0``: the plan does not model clipping's norm, NOTE [planned offload] in
meshlm/plan/offload.py) in processes of their own, and prints a markdown table with the
signed error of the plan, (planned - measured) / measured, and the worst row.  Run it under
``flock`` on a shared machine: every row starts 2 or 4 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = ["train.batch_size=8", "train.seq_len=32", "train.grad_clip=0"]
TRAIN = ["train.steps=3", "train.val_every=0", "train.val_batches=1", "train.progress=false", "train.pg_timeout_s=120"]
MODELS = ["llama_tiny", "llama_small", "gpt2_tiny", "vlm_tiny"]
#: what a model trains on besides the default text (the vision-language model: images and captions)
MODEL_ARGS = {"vlm_tiny": ["data.format=images", "train.seq_len=48"]}  # 16 image tokens and a caption
MESHES = {  # one CPU mesh per layout (2 ranks, 4 for two mesh axes, 8 for three), and what it needs
    "single": "mesh.dp=1 mesh.fsdp=1 mesh.tp=1",
    "ddp": "mesh=dp2",
    "zero1": "mesh=dp2",
    "zero2": "mesh=dp2",
    "fsdp": "mesh=fsdp2",
    "hsdp": "mesh=dp2_fsdp2",
    "tp": "mesh=tp2",
    "tp_sp": "mesh=tp2",
    "fsdp_tp": "mesh=fsdp2_tp2",
    "fsdp_tp_sp": "mesh=fsdp2_tp2",
    "pp": "mesh=pp2 train.grad_accum=2",  # 1F1B: a micro-batch per stage at least
    "fsdp_pp": "mesh=fsdp2_pp2 train.grad_accum=2",
    "fsdp_tp_pp": "mesh=fsdp2_tp2_pp2 train.grad_accum=2",
    "vlm_fsdp_tp": "mesh=fsdp2_tp2",
}


def layouts_for(model: str) -> list[str]:
    """The shipped layouts a model trains under: the vision-language layout for the
    vision-language model only (its scopes name the model's towers)."""
    from meshlm.layout.rules import shipped_layouts

    vlm = model.startswith("vlm")
    return [n for n in shipped_layouts() if (n == "vlm_fsdp_tp") == vlm or (vlm and n in ("ddp", "fsdp"))]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.app.cli", *args], cwd=REPO, env=_env(), capture_output=True, text=True
    )


def row(model: str, layout: str) -> dict:
    mesh = MESHES[layout].split()
    args = [f"model={model}", f"layout={layout}", *mesh, *RUN, *MODEL_ARGS.get(model, [])]
    p = _cli("plan", *args, "plan.format=json", "plan.profile=cpu")
    if p.returncode:
        err = "not planned: " + p.stderr.strip().splitlines()[-1].removeprefix("meshlm plan: error: ")
        return {"model": model, "layout": layout, "mesh": " ".join(mesh), "error": err}
    plan = json.loads(p.stdout)
    with tempfile.TemporaryDirectory() as d:
        t = _cli("train", *args, *TRAIN, f"hydra.run.dir={d}")
        if t.returncode:
            err = "meshlm train failed: " + t.stderr.strip()[-300:]
            return {"model": model, "layout": layout, "mesh": " ".join(mesh), "error": err}
        s = json.loads((Path(d) / "summary.json").read_text())
    return {
        "model": model,
        "layout": layout,
        "mesh": " ".join(mesh),
        "planned_peak": plan["memory"]["total"],  # a pipeline's: its fullest pp rank's
        "peak": s["mem_peak_bytes"],
        "planned_comm": plan["comm_wire_bytes_total"],
        "comm": s["comm_bytes_per_step"],
    }


def _err(planned, measured) -> float | None:
    if planned is None or not measured:
        return None if measured else (0.0 if not planned else None)
    return (planned - measured) / measured


def table(rows: list[dict]) -> str:
    out = [
        "| model | layout | mesh | peak planned MiB | peak measured MiB | error | sent planned MiB | sent measured MiB "
        "| error |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    worst = None
    order = {**{m: i for i, m in enumerate(MODELS)}}
    rows = sorted(rows, key=lambda r: (order.get(r["model"], 99), list(MESHES).index(r["layout"])))
    for r in rows:
        if "error" in r:
            why = r["error"].removeprefix("not planned: meshlm plan: error: ").split(";")[0]
            out.append(f"| {r['model']} | {r['layout']} | {r['mesh']} | {why} | | | | | |")
            continue
        ep, ec = _err(r["planned_peak"], r["peak"]), _err(r["planned_comm"], r["comm"])
        for what, e in (("peak", ep), ("bytes sent", ec)):
            if e is not None and (worst is None or abs(e) > abs(worst[0])):
                worst = (e, what, r)

        def pct(e):
            return "n/a" if e is None else f"{100 * e:+.2f}%"

        mib = 2**20
        out.append(
            f"| {r['model']} | {r['layout']} | {r['mesh']} | {r['planned_peak'] / mib:.3f} | {r['peak'] / mib:.3f} | "
            f"{pct(ep)} | {r['planned_comm'] / mib:.3f} | {(r['comm'] or 0) / mib:.3f} | {pct(ec)} |"
        )
    if worst:
        e, what, r = worst
        out.append(f"\nWorst: {100 * e:+.2f}% ({what}), {r['model']} under {r['layout']} ({r['mesh']}).")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layouts", default=None, help="comma-separated; default: every one the model trains under")
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines here (appended)")
    ap.add_argument("--table", default=None, help="print the table of the rows in this JSON-lines file, run nothing")
    a = ap.parse_args()
    if a.table:
        print(table([json.loads(line) for line in Path(a.table).read_text().splitlines() if line.strip()]))
        sys.exit(0)
    rows = []
    for model in a.models.split(","):
        for layout in a.layouts.split(",") if a.layouts else layouts_for(model):
            r = row(model, layout)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(table(rows))
