"""meshlm against torch's own parallel APIs and torchtitan, side by side, on 4 CPU ranks.

    python benchmarks/bench_layouts.py [--layouts fsdp,tp_sp] [--steps 2] [--reps 3]
                                       [--seq 256] [--batch 8] [--backend aot_eager|inductor]

For each shipped multi-device layout, on one 4-rank gloo pool (harness.DistPool),
with the small Llama (llama_small, fp32, AdamW), it builds side by side:
  meshlm     meshlm.shard(Llama(cfg, device="meta"), layout, mesh) + ShardedOptimizer
  torch      benchmarks/baseline_llama.py: the same model written with nn.Linear, parallelised
             by hand with torch's APIs the way torchtitan does it (DDP, ZeroRedundancyOptimizer,
             fully_shard, parallelize_module + loss_parallel)
  titan      torchtitan 0.3.0's own Llama 3 and parallelize_llama (benchmarks/titan_llama.py),
             when it is installed (`pip install -e .[bench]`); otherwise the column is skipped
each eager and compiled per block (the compiled variants are built only after every eager
one has been warmed up).  After one warm-up step each, it runs `--reps` rounds; in each round
every variant runs `--steps` timed steps in turn (interleaved, so load on the shared machine
hits all alike).  Step time = the slowest rank's time of one full step (forward, backward,
optimizer), median over all timed steps.

Per variant it also measures, in separate untimed steps:
- collectives and logical / ring bytes per rank per step (meshlm.runtime.comm.CommCounter; eager);
- peak memory per rank: the peak of *tracked tensor storage* (every storage a torch op
  returns, plus parameters and optimizer state held before the step; gloo's internal buffers
  and the Python heap are not counted), eager only;
- under compile: the collectives inside the compiled block graphs (counted in the AOT
  forward and backward FX graphs, times the number of blocks), against the eager count.

The analytic budget is meshlm.plan.plan(...).comm (the formulas in docs/layouts.md's shipped-layouts table).  Gloo
emulates reduce-scatter with an all-reduce: its time is not the ring algorithm's, so
compare bytes, not communication time.

Writes benchmarks/results/layouts.json and benchmarks/results/layouts.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from harness.memory import PeakStorage  # noqa: E402, F401  (re-exported for the other benchmarks)

LAYOUTS = {  # the shipped multi-device layouts and their 4-rank meshes (as tests/dist)
    "ddp": {"dp": 4},
    "zero1": {"dp": 4},
    "zero2": {"dp": 4},
    "fsdp": {"fsdp": 4},
    "hsdp": {"dp": 2, "fsdp": 2},
    "tp": {"tp": 4},
    "tp_sp": {"tp": 4},
    "fsdp_tp": {"fsdp": 2, "tp": 2},
    "fsdp_tp_sp": {"fsdp": 2, "tp": 2},
}
RESULTS = Path(__file__).resolve().parent / "results"
LR = 1e-3


# --------------------------------------------------------------------------- measuring
# PeakStorage lives in harness.memory (shared with the memory tests); imported above.


def _state_tensors(model, opt):
    ts = [p for p in model.parameters()]
    inner = getattr(opt, "inner", opt)
    for st in inner.state.values():
        ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    masters = getattr(opt, "masters", None)
    if callable(masters):
        ts += list(masters().values())
    return ts


class GraphCollectives:
    """A compile backend that is aot_eager, and counts the collectives in every forward and
    backward graph it compiles (per graph, so a block graph reused by L layers counts once)."""

    def __init__(self):
        self.graphs: list[tuple[str, dict[str, int]]] = []

    def _counter(self, kind):
        from functorch.compile import make_boxed_func

        def compile_fn(gm, example_inputs):
            counts: dict[str, int] = {}
            for n in gm.graph.nodes:
                if n.op == "call_function" and "c10d" in str(getattr(n.target, "namespace", "")):
                    name = n.target._opname if hasattr(n.target, "_opname") else str(n.target)
                    if name in ("wait_tensor",):
                        continue
                    counts[name] = counts.get(name, 0) + 1
            self.graphs.append((kind, counts))
            return make_boxed_func(gm.forward)

        return compile_fn

    def backend(self):
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=self._counter("forward"), bw_compiler=self._counter("backward"))


# --------------------------------------------------------------------------- builders
def _global_batch(cfg, batch, seq):
    toks = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def _build_meshlm(cfg, layout, mesh_sizes, X, Y, backend, bucket=True):
    import meshlm
    from meshlm.models import Llama
    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, bucket=bucket)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=LR)
    if backend is not None:
        compile_blocks(model, backend=backend)
    x, y = meshlm.shard_batch(X, layout, mesh), meshlm.shard_batch(Y, layout, mesh)

    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return dict(model=model, opt=opt, step=step, mesh=mesh)


def _build_torch(cfg, layout, mesh_sizes, X, Y, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import loss_parallel

    import baseline_llama as bl
    from meshlm.models import Llama

    names = tuple(mesh_sizes)
    mesh = init_device_mesh("cpu", tuple(mesh_sizes.values()), mesh_dim_names=names)
    model = bl.load_from_meshlm(bl.BaselineLlama(cfg), Llama(cfg, seed=0))
    tp = "tp" in layout
    if tp:
        bl.apply_tp(model, mesh["tp"], sequence_parallel=layout.endswith("_sp"))
    if backend is not None:  # per block, after TP and before FSDP, as torchtitan
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
    opt = None
    if layout in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        if layout == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    elif layout in ("zero2", "fsdp", "hsdp", "fsdp_tp", "fsdp_tp_sp"):
        dp_mesh = mesh[("dp", "fsdp")] if layout == "hsdp" else (mesh["fsdp"] if "fsdp" in names else mesh)
        bl.apply_fsdp(model, dp_mesh, reshard_after_forward=layout != "zero2")
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # batch: split over the data axes (dp, fsdp); whole on tp ranks
    n_dp, dp_rank = 1, 0
    for a in ("dp", "fsdp"):
        if a in names:
            n_dp, dp_rank = n_dp * mesh_sizes[a], dp_rank * mesh_sizes[a] + mesh[a].get_local_rank()
    b = X.shape[0] // n_dp
    x, y = X[dp_rank * b : (dp_rank + 1) * b], Y[dp_rank * b : (dp_rank + 1) * b]
    ctx = loss_parallel if tp else nullcontext

    def step():
        with ctx():
            loss = bl.loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return dict(model=model, opt=opt, step=step, mesh=mesh)


def _build_titan(cfg, layout, mesh_sizes, X, Y, backend):
    import titan_llama

    model, opt, step_xy, shard = titan_llama.build(cfg, layout, mesh_sizes, X.shape[1], backend, LR)
    x, y = shard(X), shard(Y)
    return dict(model=model, opt=opt, step=lambda: step_xy(x, y), mesh=None)


BUILDERS = {"meshlm": _build_meshlm, "torch": _build_torch, "titan": _build_titan}


# --------------------------------------------------------------------------- one layout
def _bench_layout(layout, mesh_sizes, opts):
    """Runs on every rank; returns this rank's measurements."""
    import torch.distributed as dist

    from meshlm.models import llama_config
    from meshlm.runtime.comm import CommCounter

    torch.manual_seed(0)
    cfg = llama_config(opts["model"])
    X, Y = _global_batch(cfg, opts["batch"], opts["seq"])
    impls = ["meshlm", "torch"] + (["titan"] if opts["titan"] and layout in opts["titan_layouts"] else [])
    variants: dict[str, dict] = {}
    errors: dict[str, str] = {}
    graph_counters: dict[str, GraphCollectives] = {}

    def build(name, backend):
        impl = name.split("/")[0]
        try:
            be = backend
            if backend == "aot_eager":  # aot_eager that also counts collectives in the graphs
                graph_counters[name] = GraphCollectives()
                be = graph_counters[name].backend()
            v = BUILDERS[impl](cfg, layout, mesh_sizes, X, Y, be)
            t0 = time.perf_counter()
            v["loss0"] = float(v["step"]())  # warm-up (and compile)
            v["warmup_s"] = time.perf_counter() - t0
            variants[name] = v
        except Exception as e:  # noqa: BLE001 - one failed variant must not sink the table
            import traceback

            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if dist.get_rank() == 0:
                traceback.print_exc()

    for impl in impls:
        build(f"{impl}/eager", None)
    if opts["backend"] != "none":
        for impl in impls:
            build(f"{impl}/compiled", opts["backend"])

    out: dict[str, dict] = {n: {"loss0": v["loss0"], "warmup_s": v["warmup_s"]} for n, v in variants.items()}
    # collectives and memory, eager, one untimed step each
    for name, v in variants.items():
        if name.endswith("/eager"):
            cc = CommCounter(v["mesh"])
            with cc:
                v["step"]()
            out[name]["collectives"] = len(cc.records)
            out[name]["bytes"] = sum(r.bytes for r in cc.records)
            out[name]["wire_bytes"] = sum(r.wire_bytes for r in cc.records)
            out[name]["by_kind"] = {
                k: sum(1 for r in cc.records if r.kind == k) for k in sorted({r.kind for r in cc.records})
            }
            dist.barrier()
            mem = PeakStorage(_state_tensors(v["model"], v["opt"]))
            with mem:
                v["step"]()
            out[name]["state_bytes"] = mem.base
            out[name]["peak_bytes"] = mem.peak
            dist.barrier()
    if "meshlm/eager" in out:
        # the same step with bucketing off: the per-parameter collective count (untimed)
        v = _build_meshlm(cfg, layout, mesh_sizes, X, Y, None, bucket=False)
        cc = CommCounter(v["mesh"])
        with cc:
            v["step"]()
        out["meshlm/eager"]["collectives_unbucketed"] = len(cc.records)
        out["meshlm/eager"]["bytes_unbucketed"] = sum(r.bytes for r in cc.records)
        del v
        dist.barrier()
    for name, gc in graph_counters.items():
        if name in out:
            out[name]["graphs"] = gc.graphs
    times = interleaved({name: v["step"] for name, v in variants.items()}, opts["reps"], opts["steps"])
    for name, ts in times.items():
        out[name]["step_s"] = statistics.median(ts)
        out[name]["times"] = ts
    out["_errors"] = errors
    return out


def interleaved(run: dict, reps: int, steps: int = 1) -> dict[str, list[float]]:
    """Time each callable of ``run`` in interleaved rounds (``reps`` rounds of ``steps``
    calls of each, in ``run``'s order), so that load on a shared machine hits all alike; each
    call starts after a barrier and counts as the slowest rank's time."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(reps):
        for name, f in run.items():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                f()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(float(dt))
    return times


# --------------------------------------------------------------------------- report
def _budget(layout, mesh_sizes, opts):
    from meshlm.plan import plan

    p = plan(opts["model"], layout, mesh_sizes, global_batch=opts["batch"], seq=opts["seq"])
    return {
        "collectives": sum(c.count for c in p.comm),
        "bytes": sum(c.bytes for c in p.comm),
        "wire_bytes": p.comm_bytes(),
    }


def _ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def _mb(x):
    return f"{x / 1e6:.1f}" if x is not None else "-"


def _block_graph_collectives(r):
    """Collectives per step inside the compiled block graphs (forward + backward), from the
    graphs of one compiled block, times the number of blocks."""
    g = r.get("graphs")
    if not g:
        return None
    return sum(sum(c.values()) for _k, c in g)


def render(results: dict, meta: dict) -> str:
    L = meta["layers"]
    lines = [
        f"Measured {meta['date']} on {meta['machine']}; torch {meta['torch']}; torchtitan {meta['torchtitan']}.",
        f"Command: `{meta['command']}`. Model {meta['model']} (fp32, AdamW), global batch {meta['batch']} x seq "
        f"{meta['seq']}, 4 gloo ranks; step = median over {meta['reps']} interleaved rounds x {meta['steps']} steps "
        f"(slowest rank); compiled = per-block torch.compile, backend `{meta['backend']}`.",
        "Memory = peak tracked tensor storage per rank in one eager step (params + grads + optimizer state + "
        "activations + communication buffers that torch allocates; not gloo internals or the Python heap).",
        "Collectives and MB are per rank per step, eager, counted by meshlm.runtime.comm.CommCounter; MB = logical bytes "
        "(NOTE [logical bytes] in meshlm/runtime/comm.py; ring bytes are not compared because CommCounter cannot size the "
        "groups of c10d ops that DDP and FSDP2 issue); budget = meshlm.plan (the formulas in docs/layouts.md's shipped-layouts table).",
        "",
        "| layout | impl | eager s | compiled s | tok/s (eager) | peak MB | colls | MB | budget MB "
        "| eager / torch | compiled / titan | mem / torch | MB / titan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, res in results.items():
        bud = res["budget"]
        tokens = meta["batch"] * meta["seq"]
        for impl in ("meshlm", "torch", "titan"):
            e, c = res.get(f"{impl}/eager"), res.get(f"{impl}/compiled")
            if e is None and c is None:
                why = res["errors"].get(f"{impl}/eager") or res.get("skipped", {}).get(impl)
                if why:
                    lines.append(f"| {layout} | {impl} | n/a: {why} |||||||||||")
                continue
            e = e or {}
            c = c or {}
            row = [
                layout,
                impl,
                f"{e['step_s']:.3f}" if e.get("step_s") else "-",
                f"{c['step_s']:.3f}" if c.get("step_s") else "-",
                f"{tokens / e['step_s']:.0f}" if e.get("step_s") else "-",
                _mb(e.get("peak_bytes")),
                str(e.get("collectives", "-")),
                _mb(e.get("bytes")),
                _mb(bud["bytes"]) if impl == "meshlm" else "",
            ]
            if impl == "meshlm":
                te, tc = res.get("torch/eager", {}), res.get("titan/compiled", {})
                ti = res.get("titan/eager", {})
                row += [
                    _ratio(e.get("step_s"), te.get("step_s")),
                    _ratio(c.get("step_s"), tc.get("step_s")),
                    _ratio(e.get("peak_bytes"), te.get("peak_bytes")),
                    _ratio(e.get("bytes"), ti.get("bytes")),
                ]
            else:
                row += ["", "", "", ""]
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Collectives per step, eager vs compiled (compiled: collectives in the compiled block graphs, "
        "forward + backward, counted once per graph and multiplied by the blocks; the embedding, head and "
        "loss stay eager).",
        "",
        "| layout | impl | eager, whole step | eager, bucketing off (per parameter) "
        "| compiled, inside the block graphs |",
        "|---|---|---|---|---|",
    ]
    for layout, res in results.items():
        for impl in ("meshlm", "torch", "titan"):
            e, c = res.get(f"{impl}/eager"), res.get(f"{impl}/compiled")
            if not e or not c or not c.get("graphs"):
                continue
            g = c["graphs"]
            per_graph = _block_graph_collectives(c)
            n_graphs = len(g)
            blocks = f"{per_graph} in {n_graphs} graphs" + (f" -> {per_graph * L} per step" if n_graphs == 2 else "")
            off = e.get("collectives_unbucketed", "")
            lines.append(f"| {layout} | {impl} | {e['collectives']} | {off} | {blocks} |")
    if meta.get("notes"):
        lines += [""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated (default: all multi-device)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument(
        "--backend",
        default="aot_eager",
        choices=["aot_eager", "inductor", "none"],
        help="compiled variants' backend (none: eager only)",
    )
    ap.add_argument("--no-titan", action="store_true", help="skip the torchtitan column")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown table of a results JSON")
    args = ap.parse_args(argv)
    if args.render:
        d = json.loads(Path(args.render).read_text())
        md = render(d["results"], d["meta"])
        Path(args.render).with_suffix(".md").write_text(md)
        print(md)
        return 0
    layouts = [x for x in args.layouts.split(",") if x]
    for lay in layouts:
        if lay not in LAYOUTS:
            ap.error(f"unknown layout {lay!r}; choose from {', '.join(LAYOUTS)}")

    import titan_llama
    from harness.dist import DistPool
    from meshlm.models import llama_config

    notes = []
    why_no_titan = "disabled by --no-titan" if args.no_titan else titan_llama.available()
    titan_version = "not used" if args.no_titan else "not installed"
    if why_no_titan:
        print(f"NOTE: torchtitan column skipped ({why_no_titan}); install it with `pip install -e .[bench]`")
        notes.append(f"torchtitan column skipped: {why_no_titan}")
    else:
        from importlib.metadata import version

        titan_version = version("torchtitan")
    opts = dict(vars(args), titan=not why_no_titan, titan_layouts=set(titan_llama.STRATEGIES))
    opts["backend"] = args.backend
    results = {}
    t_start = time.time()
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    with DistPool(4, timeout_s=300, env=env, job_timeout_s=3600) as pool:
        for lay in layouts:
            t0 = time.time()
            try:
                per_rank = pool.run(_bench_layout, lay, LAYOUTS[lay], opts)
                r = dict(per_rank[0])
                # memory: the largest rank
                for name in r:
                    if name != "_errors" and "peak_bytes" in r[name]:
                        r[name]["peak_bytes"] = max(p[name]["peak_bytes"] for p in per_rank)
                errors = r.pop("_errors")
            except Exception as e:  # noqa: BLE001
                r, errors = {}, {"all": f"{type(e).__name__}: {str(e)[:300]}"}
            r["errors"] = errors
            r["mesh"] = LAYOUTS[lay]
            r["budget"] = _budget(lay, LAYOUTS[lay], opts)
            if lay not in titan_llama.STRATEGIES:
                r["skipped"] = {"titan": "no torchtitan equivalent"}
            elif why_no_titan:
                r["skipped"] = {"titan": f"torchtitan column skipped: {why_no_titan}"}
            results[lay] = r
            m, t, ti = r.get("meshlm/eager", {}), r.get("torch/eager", {}), r.get("titan/eager", {})
            print(
                f"[{lay} {LAYOUTS[lay]}] {time.time() - t0:.0f}s  "
                f"meshlm {m.get('step_s', float('nan')):.3f}s/{r.get('meshlm/compiled', {}).get('step_s', float('nan')):.3f}s  "
                f"torch {t.get('step_s', float('nan')):.3f}s/{r.get('torch/compiled', {}).get('step_s', float('nan')):.3f}s  "
                f"titan {ti.get('step_s', float('nan')):.3f}s/{r.get('titan/compiled', {}).get('step_s', float('nan')):.3f}s  "
                f"ring MB meshlm {_mb(m.get('wire_bytes'))} budget {_mb(r['budget']['wire_bytes'])} "
                f"torch {_mb(t.get('wire_bytes'))} titan {_mb(ti.get('wire_bytes'))}"
                + (f"  errors {errors}" if errors else ""),
                flush=True,
            )
    cfg = llama_config(args.model)
    if args.backend == "aot_eager":
        notes.append(
            "compiled = aot_eager (traced and partitioned, no inductor fusion): inductor on all variants "
            "does not fit the time budget on 2 shared cores; rerun with --backend inductor"
        )
    meta = dict(
        date=datetime.date.today().isoformat(),
        command="python benchmarks/bench_layouts.py " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=f"{platform.machine()}, {os.cpu_count()} cores (shared), {platform.python_version()}",
        torch=torch.__version__,
        torchtitan=titan_version,
        model=args.model,
        layers=cfg.layers,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        reps=args.reps,
        backend=args.backend,
        wall_s=round(time.time() - t_start),
        notes=notes,
    )
    out = Path(args.out)

    def clean(o):
        if isinstance(o, dict):
            return {
                k: clean(v)
                for k, v in o.items()
                if isinstance(v, (str, int, float, bool, list, tuple, dict, set, type(None)))
            }
        if isinstance(o, (list, tuple)):
            return [clean(x) for x in o]
        if isinstance(o, set):
            return sorted(o)
        return o

    write_report(out, "layouts", clean({"meta": meta, "results": results}), render(results, meta), meta["wall_s"])
    return 0


def write_report(out: Path, stem: str, data: dict, md: str, wall_s) -> None:
    """``out/stem.json`` and ``out/stem.md``, and the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')} ({wall_s} s)")


if __name__ == "__main__":
    sys.exit(main())
