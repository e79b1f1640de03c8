"""meshlm's pipeline parallelism against torchtitan's, side by side, on 4 CPU ranks.

    python benchmarks/pipeline_titan.py [--model llama_small] [--batch 8] [--seq 128]
                                        [--microbatches 4] [--schedule 1f1b] [--reps 3]
                                        [--backend none|aot_eager|inductor] [--early] [--out DIR]

On one 4-rank gloo pool (harness.DistPool), with the same Llama (``--model``, the
same seed-0 weights, fp32, AdamW, the same global batch), for two meshes:

  pp=2 x fsdp=2   meshlm: layout ``fsdp_pp``; torchtitan 0.3.0: pipeline_parallel_degree=2,
                  data_parallel_shard_degree=2 (its FSDP2 inside each stage)
  pp=4            meshlm: layout ``pp``; torchtitan: pipeline_parallel_degree=4

both on torch's ``--schedule`` with ``--microbatches`` micro-batches, stages of equal block
counts (meshlm ``pipeline.split``, torchtitan's first/last-stage-less-layers 0), eager and,
with ``--backend``, compiled per block (meshlm ``compile_blocks``, torchtitan's own
per-block compile).  torchtitan runs its own model, module split (copies of the model with
the other stages' layers deleted), ``parallelize_llama`` and schedule builder
(benchmarks/titan_llama.py ``build_pipeline``); meshlm runs the model with no pipeline
code in it (meshlm/runtime/pipeline/).  ``--early`` adds meshlm compiled with early reduction
(``Pipeline.attach(opt, early=True)``, NOTE [early reduction] in meshlm/runtime/optim/early.py;
off by default on a CPU mesh).  After a warm-up step each, ``--reps`` rounds time one step
of every variant in turn (interleaved: load on the machine hits all alike; a step is the
slowest rank's time, the median over rounds).  In separate untimed steps: the peak of
tracked tensor storage per rank (the largest rank's; eager) and the bytes each rank puts on
the wire per step (meshlm.runtime.comm.CommCounter: collectives' ring bytes and point-to-point
sends; eager), the largest rank's.  Ratios meshlm / torchtitan.

Writes DIR/pipeline_titan.json and DIR/pipeline_titan.md (default
benchmarks/results/pipeline_titan/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

CASES = {"pp=2,fsdp=2": ("fsdp_pp", {"fsdp": 2, "pp": 2}), "pp=4": ("pp", {"pp": 4})}
LR = 1e-3


def _build_meshlm(cfg, layout, mesh_sizes, X, Y, opts, backend, early=None):
    import meshlm
    from meshlm.models import Llama
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh

    full, sub = pipeline_mesh(mesh_sizes)
    m, pp = opts["microbatches"], mesh_sizes["pp"]
    micro = X.shape[0] // m
    ex = (X[:micro], Y[:micro])
    pipe = build_pipeline(
        lambda d: Llama(cfg, device=d),
        layout,
        full,
        sub,
        example=(ex, {}),
        microbatches=m,
        schedule=opts["schedule"],
        split=[cfg.layers // pp] * pp,
        seed=0,
    )
    if backend is not None:
        from meshlm.runtime.compile import compile_blocks

        compile_blocks(pipe.model, backend, comms="eager")  # as meshlm train compiles a pipeline
    opt = ShardedOptimizer(pipe.model, torch.optim.AdamW, lr=LR)
    pipe.attach(opt, early=early)  # as meshlm train: the norm over every stage (early: NOTE [early reduction])
    lay = meshlm.load_layout(layout)
    inputs = [
        (
            (
                meshlm.shard_batch(X[i * micro : (i + 1) * micro], lay, sub),
                meshlm.shard_batch(Y[i * micro : (i + 1) * micro], lay, sub),
            ),
            {},
        )
        for i in range(m)
    ]

    def step():
        loss = pipe.step(inputs)
        opt.step()
        opt.zero_grad()
        return loss

    return dict(step=step, mesh=full, state=lambda: _state(list(pipe.model.parameters()), opt.inner))


def _build_titan(cfg, layout, mesh_sizes, X, Y, opts, backend):
    import titan_llama
    from meshlm.models import Llama

    p = titan_llama.build_pipeline(
        cfg,
        mesh_sizes,
        X.shape[1],
        X.shape[0],
        opts["microbatches"],
        opts["schedule"],
        backend,
        LR,
        weights=Llama(cfg, device="cpu", seed=0),
    )
    dims = p["dims"]
    fs = mesh_sizes.get("fsdp", 1)
    r = dims.get_mesh("batch").get_local_rank() if fs > 1 else 0
    b = X.shape[0] // fs
    x, y = X[r * b : (r + 1) * b], Y[r * b : (r + 1) * b]
    params = [q for part in p["parts"] for q in part.parameters()]
    return dict(step=lambda: p["step"](x, y), mesh=dims.get_mesh("pp"), state=lambda: _state(params, p["opt"]))


def _state(params, opt) -> list:
    return params + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _bench(case: str, opts: dict) -> dict:
    import torch.distributed as dist

    from bench_layouts import interleaved
    from harness.memory import PeakStorage
    from meshlm.models import llama_config
    from meshlm.runtime.comm import CommCounter

    layout, mesh_sizes = CASES[case]
    cfg = llama_config(opts["model"])
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab, (opts["batch"], opts["seq"] + 1), generator=g)
    X, Y = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    builders = {"meshlm": _build_meshlm, "titan": _build_titan}
    variants, out = {}, {}
    backends = [None] + ([opts["backend"]] if opts["backend"] != "none" else [])
    for be in backends:
        for impl, build in builders.items():
            name = f"{impl}/{'eager' if be is None else 'compiled'}"
            v = build(cfg, layout, mesh_sizes, X, Y, opts, be)
            v["step"]()  # warm-up (and compile)
            variants[name] = v
            out[name] = {}
        if opts.get("early") and be is not None:  # meshlm with early reduction, compiled
            v = _build_meshlm(cfg, layout, mesh_sizes, X, Y, opts, be, early=True)
            v["step"]()
            variants["meshlm/early"] = v
            out["meshlm/early"] = {}
    for name, v in variants.items():
        if name.endswith("/eager"):
            cc = CommCounter(v["mesh"])
            with cc:
                v["step"]()
            wire = torch.tensor([sum(r.wire_bytes for r in cc.records)], dtype=torch.float64)
            sent = torch.tensor([sum(r.bytes for r in cc.records if r.kind == "send")], dtype=torch.float64)
            dist.barrier()
            mem = PeakStorage(v["state"]())
            with mem:
                v["step"]()
            peak = torch.tensor([float(mem.peak)], dtype=torch.float64)
            for t in (wire, sent, peak):
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[name].update(wire_bytes=float(wire), p2p_bytes=float(sent), peak_bytes=float(peak))
    times = interleaved({name: v["step"] for name, v in variants.items()}, opts["reps"])
    for name, ts in times.items():
        out[name]["step_s"] = statistics.median(ts)
        out[name]["times"] = ts
    return out


def render(results: dict, meta: dict) -> str:
    lines = [
        f"# meshlm pipeline parallelism against torchtitan {meta['torchtitan']}, {meta['model']}, 4 CPU ranks",
        "",
        f"Measured {meta['date']} on {meta['machine']}; torch {meta['torch']}; `{meta['command']}`.",
        f"Global batch {meta['batch']} x seq {meta['seq']}, {meta['microbatches']} micro-batches, schedule "
        f"{meta['schedule']}, fp32, AdamW. Step: the slowest rank's, median of {meta['reps']} interleaved rounds. "
        "Memory: the largest rank's peak of tracked tensor storage (eager). Bytes: the largest rank's bytes on the "
        "wire per step (ring bytes of its collectives, and its point-to-point sends; eager).",
        "",
        "| mesh | variant | step s (meshlm) | step s (titan) | step meshlm / titan | peak MB meshlm / titan | "
        "wire MB meshlm / titan | p2p MB meshlm / titan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, res in results.items():
        for kind in ("eager", "compiled", "early"):
            m, t = res.get(f"meshlm/{kind}"), res.get(f"titan/{kind if kind != 'early' else 'compiled'}")
            if not m or not t:
                continue
            e_m, e_t = res["meshlm/eager"], res["titan/eager"]
            lines.append(
                f"| {case} | {kind if kind != 'early' else 'compiled, early reduction'} | {m['step_s']:.3f} | {t['step_s']:.3f} | {m['step_s'] / t['step_s']:.2f}x | "
                + (
                    f"{e_m['peak_bytes'] / 1e6:.1f} / {e_t['peak_bytes'] / 1e6:.1f} | "
                    f"{e_m['wire_bytes'] / 1e6:.2f} / {e_t['wire_bytes'] / 1e6:.2f} | "
                    f"{e_m['p2p_bytes'] / 1e6:.2f} / {e_t['p2p_bytes'] / 1e6:.2f} |"
                    if kind == "eager"
                    else "(eager's) | | |"
                )
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="meshlm vs torchtitan pipeline parallelism on 4 CPU ranks")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="none", choices=["none", "aot_eager", "inductor"])
    ap.add_argument(
        "--early", action="store_true", help="also meshlm compiled with early reduction (NOTE [early reduction])"
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pipeline_titan"))
    args = ap.parse_args(argv)
    import titan_llama

    why = titan_llama.available()
    if why:
        raise SystemExit(f"torchtitan is needed (pip install -e '.[bench]'): {why}")
    from importlib.metadata import version

    from harness import DistPool

    opts = vars(args)
    results = {}
    with DistPool(4, timeout_s=300, job_timeout_s=3600) as pool:
        for case in CASES:
            results[case] = pool.run(_bench, case, opts)[0]
    meta = dict(
        opts,
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        torch=torch.__version__,
        torchtitan=version("torchtitan"),
        command="python benchmarks/pipeline_titan.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_titan.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    text = render(results, meta)
    (out / "pipeline_titan.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
