"""The phases of a meshlm training step (forward, backward, optimizer), two variants of a knob
side by side, on 4 CPU ranks.

    python benchmarks/step_phases.py --layouts ddp --overlap both [--seq 32] [--steps 3] [--reps 3]
    python benchmarks/step_phases.py --layouts fsdp --regather both
    python benchmarks/step_phases.py --layouts fsdp,hsdp --comms both --compile aot_eager
                                     [--mesh fsdp=4] [--batch 8] [--warmup 1] [--out DIR]

The knobs (one of them may be `both`, which compares its two values):
  --overlap {off,on}            meshlm.shard(..., overlap=False/True): each block's gradient
                                reduction left in flight while backward goes on
                                (NOTE [overlapped reduction] in meshlm/runtime/bucket/op.py)
  --comms {graph,eager}         with --compile: meshlm.compile_blocks(..., comms=...): whether
                                the data-parallel collectives of local blocks are compiled
                                into the block's graphs or run eagerly around its compiled math
                                (NOTE [compiled body] in meshlm/runtime/compile.py)
  --opt-bucket {block,25}       ShardedOptimizer(bucket_mb=None or 25): the ZeRO-1/2 optimizer's
                                flat collectives one per block, or merged up to 25 MiB
                                (NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py)
  --regather {free,recompute}   meshlm.runtime.lowering.blocks.EAGER_REGATHER: how an eager ZeRO-3 block (fsdp,
                                hsdp, fsdp_tp, fsdp_tp_sp) re-gathers its parameters in
                                backward: "free" frees them after forward and gathers them
                                again (NOTE [free and re-gather] in meshlm/runtime/bucket/regather.py);
                                "recompute" checkpoints the block (a local block recomputes its
                                whole forward, a tensor-parallel one under the selective
                                policy); no effect on layouts without re-gathering blocks (the
                                table says how many there are)

For each layout, on one 4-rank gloo pool (harness.DistPool), every rank builds both
variants of the small Llama (llama_small, fp32, `ShardedOptimizer` over AdamW, the same
seeded global batch through `meshlm.shard_batch`), runs `--warmup` untimed steps of each,
then `--reps` interleaved rounds (A's `--steps` steps, B's, A's, ...), so that load on the
shared machine hits both alike.  Each timed step starts after a barrier and measures on each
rank:
  fwd   loss = model(x, y)
  bwd   loss.backward(): with overlap, until the engine's end-of-backward callback has
        waited for every gradient reduction still in flight
  opt   opt.step() and opt.zero_grad()
  step  the three together.
Each is the slowest rank's time in that step (so step may exceed fwd + bwd + opt, whose
slowest ranks may differ); the table gives medians over reps x steps.  Peak MB: one more
step of each variant under bench_layouts.PeakStorage (tracked tensor storage, the largest
rank; eager only, `-` with --compile).  Both variants take
the same steps on the same batch, so their losses should agree: the largest difference is
reported.  Gloo runs its communication on threads that compete with the compute for the
cores: on a small shared CPU machine overlap can cost rather than save.

Writes DIR/<knob>.json and DIR/<knob>.md (default DIR: benchmarks/results/step_phases).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

# the 4-rank meshes, the batch, memory, the report
from bench_layouts import LAYOUTS, PeakStorage, _global_batch, _state_tensors, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "step_phases"
LR = 1e-3
PHASES = ("fwd", "bwd", "opt", "step")
KNOBS = {
    "overlap": ("off", "on"),
    "regather": ("free", "recompute"),
    "comms": ("graph", "eager"),
    "opt_bucket": ("block", "25"),
}


# --------------------------------------------------------------------------- on every rank
def _regather_blocks(model) -> int:
    """How many blocks of ``model`` re-gather their parameters (those the regather knob
    switches)."""
    n = 0
    for m in model.modules():
        spec = getattr(m, "_meshlm_block", None)
        if spec is not None and spec.regather:
            n += 1
    return n


def _bench_layout(layout, mesh_shape, variants, opts):
    """Runs on every rank; returns the per-step phase times (slowest rank) per variant."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshlm
    import meshlm.runtime.lowering.blocks
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    torch.manual_seed(0)
    cfg = llama_config(opts["model"])
    X, Y = _global_batch(cfg, opts["batch"], opts["seq"])
    mesh = meshlm.make_mesh(mesh_shape)
    x, y = meshlm.shard_batch(X, layout, mesh), meshlm.shard_batch(Y, layout, mesh)
    regather0 = meshlm.runtime.lowering.blocks.EAGER_REGATHER
    built = {}
    for v in variants:
        model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0, overlap=v["overlap"])
        if opts["compile"] != "none":
            compile_blocks(model, opts["compile"], comms=v["comms"])
        opt = ShardedOptimizer(
            model, torch.optim.AdamW, lr=LR, bucket_mb=None if v["opt_bucket"] == "block" else float(v["opt_bucket"])
        )
        built[v["name"]] = (model, opt, v["regather"])

    def step(name):
        model, opt, regather = built[name]
        meshlm.runtime.lowering.blocks.EAGER_REGATHER = regather
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        dt = torch.tensor([t1 - t0, t2 - t1, t3 - t2, t3 - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        loss = loss.detach()
        return dt.tolist(), float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    out = {
        v["name"]: {"times": [], "losses": [], "regather_blocks": _regather_blocks(built[v["name"]][0])}
        for v in variants
    }
    try:
        for name in built:  # warm-up, untimed; the losses still count for the comparison
            for _ in range(opts["warmup"]):
                out[name]["losses"].append(step(name)[1])
        for _ in range(opts["reps"]):
            for name in built:
                for _ in range(opts["steps"]):
                    ts, loss = step(name)
                    out[name]["times"].append(ts)
                    out[name]["losses"].append(loss)
        # peak memory: one more step of each variant under PeakStorage (eager blocks only: a
        # dispatch mode around compiled blocks would make Dynamo skip their frames)
        for name, (model, opt, _rg) in built.items():
            if opts["compile"] != "none":
                out[name]["peak_bytes"] = None
                continue
            mem = PeakStorage(_state_tensors(model, opt))
            with mem:
                step(name)
            peak = torch.tensor([float(mem.peak)], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out[name]["peak_bytes"] = int(peak.item())
    finally:
        meshlm.runtime.lowering.blocks.EAGER_REGATHER = regather0
    for r in out.values():
        for i, ph in enumerate(PHASES):
            r[f"{ph}_s"] = statistics.median(t[i] for t in r["times"])
    return out


# --------------------------------------------------------------------------- report
def _variants(args):
    """(knob compared or None, [variant A, variant B] or [the one variant])."""
    both = [k for k in KNOBS if getattr(args, k) == "both"]
    knob = both[0] if both else None
    names = KNOBS[knob] if knob else (None,)
    out = []
    for val in names:
        v = {k: val if k == knob else getattr(args, k) for k in KNOBS}
        name = f"{knob}={val}" if knob else ",".join(f"{k}={x}" for k, x in v.items())
        out.append(dict(v, name=name, overlap=v["overlap"] == "on"))
    return knob, out


def _fmt(x):
    return f"{x:.3f}" if x is not None else "-"


def render(results: dict, meta: dict) -> str:
    lines = [
        f"Measured {meta['date']} on {meta['machine']}; torch {meta['torch']}.",
        f"Command: `{meta['command']}`. Model {meta['model']} (fp32, AdamW), global batch {meta['batch']} x seq "
        f"{meta['seq']}; {meta['warmup']} warm-up step(s) per variant, then median of {meta['reps']} interleaved "
        f"rounds x {meta['steps']} steps; each phase is the slowest rank's time in that step "
        f"({meta['knob_help']}).",
        "",
        "| layout | mesh | variant | fwd s | bwd s | opt s | step s | step B/A | peak MB | peak B/A |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for layout, res in results.items():
        if "error" in res:
            lines.append(f"| {layout} | {res['mesh']} | n/a: {res['error']} ||||||||")
            continue
        names = [n for n in res if n not in ("mesh", "loss_diff")]
        a = res[names[0]]
        for k, n in enumerate(names):
            r = res[n]
            ratio = f"{r['step_s'] / a['step_s']:.2f}" if k else ""
            pk, pa = r.get("peak_bytes"), a.get("peak_bytes")
            peak = f"{pk / 1e6:.1f}" if pk else "-"
            pratio = f"{pk / pa:.2f}" if k and pk and pa else ""
            lines.append(
                f"| {layout} | {res['mesh']} | {n} | "
                + " | ".join(_fmt(r[f"{p}_s"]) for p in PHASES)
                + f" | {ratio} | {peak} | {pratio} |"
            )
        if len(names) > 1:
            notes.append(
                f"{layout}: largest loss difference between the variants over the "
                f"{len(a['losses'])} steps: {res['loss_diff']:.2e}; "
                f"blocks that re-gather: {a['regather_blocks']}"
            )
    lines += [""] + [f"- {n}" for n in notes + meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="ddp", help="comma-separated names of layouts/*.yaml (default: ddp)")
    ap.add_argument("--mesh", help="mesh for every layout, e.g. 'fsdp=4' (default: bench_layouts.py's 4-rank mesh)")
    ap.add_argument("--overlap", default="off", choices=["off", "on", "both"])
    ap.add_argument("--regather", default="free", choices=["free", "recompute", "both"])
    ap.add_argument(
        "--comms",
        default="graph",
        choices=["graph", "eager", "both"],
        help="with --compile: meshlm.compile_blocks(..., comms=...)",
    )
    ap.add_argument(
        "--opt-bucket",
        dest="opt_bucket",
        default="block",
        choices=["block", "25", "both"],
        help="ShardedOptimizer(bucket_mb=None or 25): the optimizer's ZeRO-1/2 chunks",
    )
    ap.add_argument(
        "--compile",
        default="none",
        choices=["none", "aot_eager", "inductor"],
        help="compile every block of both variants with this backend (default: eager)",
    )
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if sum(getattr(args, k) == "both" for k in KNOBS) > 1:
        ap.error("compare one knob at a time: one of --overlap, --regather, --comms, --opt-bucket may be 'both'")
    if args.comms != "graph" and args.compile == "none":
        ap.error("--comms only matters for compiled blocks: add --compile aot_eager (or inductor)")
    if min(args.steps, args.reps) < 1 or args.warmup < 0:
        ap.error("--steps and --reps must be at least 1, --warmup at least 0")

    from harness.dist import DistPool
    from meshlm.layout.mesh import MeshSpec
    from meshlm.layout.rules import load_layout

    layouts = [x for x in args.layouts.split(",") if x]
    meshes = {}
    for lay in layouts:
        try:
            load_layout(lay)
        except Exception as e:  # noqa: BLE001 - the message names the shipped layouts
            ap.error(str(e))
        shape = args.mesh or LAYOUTS.get(lay)
        if shape is None:
            ap.error(f"no default 4-rank mesh for layout {lay!r} (have: {', '.join(LAYOUTS)}); pass --mesh")
        spec = MeshSpec.parse(shape, 4)
        if spec.size != 4:
            ap.error(f"mesh {shape} has {spec.size} devices; this benchmark runs 4 ranks")
        meshes[lay] = ",".join(f"{a}={s}" for a, s in spec.active())
    knob, variants = _variants(args)
    opts = dict(
        model=args.model,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        reps=args.reps,
        warmup=args.warmup,
        compile=args.compile,
    )

    results = {}
    t_start = time.time()
    with DistPool(4, timeout_s=300, job_timeout_s=3600) as pool:
        for lay in layouts:
            t0 = time.time()
            try:
                r = dict(pool.run(_bench_layout, lay, meshes[lay], variants, opts)[0])
            except Exception as e:  # noqa: BLE001 - one failed layout must not sink the table
                print(f"[{lay}] failed: {e}", file=sys.stderr, flush=True)
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            if "error" not in r and len(variants) > 1:
                la, lb = (r[v["name"]]["losses"] for v in variants)
                r["loss_diff"] = max(abs(p - q) for p, q in zip(la, lb))
            r["mesh"] = meshes[lay]
            results[lay] = r
            summary = "  ".join(
                f"{v['name']} " + "/".join(_fmt(r[v["name"]][f"{p}_s"]) for p in PHASES)
                for v in variants
                if v["name"] in r
            )
            print(f"[{lay} {meshes[lay]}] {time.time() - t0:.0f}s  fwd/bwd/opt/step s: {summary}", flush=True)

    knob_help = {
        "overlap": "overlap = shard(..., overlap=...)",
        "regather": "regather = meshlm.runtime.lowering.blocks.EAGER_REGATHER",
        "comms": "comms = meshlm.runtime.compile.compile_blocks(..., comms=...)",
        "opt_bucket": "opt_bucket = ShardedOptimizer(bucket_mb=None (block) or 25)",
        None: "one variant",
    }[knob]
    notes = []
    if knob == "regather":
        notes.append(
            "regather only changes blocks that re-gather their parameters (fsdp-family layouts); "
            f"overlap {args.overlap} in both variants"
        )
    elif knob == "overlap":
        notes.append(f"regather {args.regather} in both variants")
    if args.compile != "none":
        notes.append(f"blocks compiled with backend {args.compile} in every variant (the warm-up steps compile)")
    meta = dict(
        date=datetime.date.today().isoformat(),
        command="python benchmarks/step_phases.py " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        torch=torch.__version__,
        model=args.model,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        reps=args.reps,
        warmup=args.warmup,
        knob=knob,
        knob_help=knob_help,
        variants=variants,
        wall_s=round(time.time() - t_start),
        notes=notes,
    )
    write_report(
        Path(args.out), knob or "phases", {"meta": meta, "results": results}, render(results, meta), meta["wall_s"]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
