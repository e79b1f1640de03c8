"""meshlm's context parallel against the same model without it and against a hand-written
torch ring attention, on 4 CPU ranks.

    python benchmarks/cp_bench.py [--model llama_small] [--seq 4096] [--rows 1] [--reps 3]
                                  [--balance | --no-balance] [--out DIR]

On one 4-rank gloo pool (harness.DistPool), the Llama ``--model`` (fp32, SGD) at ``--seq``
tokens, every rank holding ``--rows`` sequences' worth of its tokens (so the global batch is
``rows * 4 / cp``: each run puts the same rows on a rank, cp splits their length):

  meshlm   layout ``fsdp`` on fsdp=4 (no cp); ``fsdp_cp`` on fsdp=2 x cp=2 and on cp=4, with
           ``context.attention`` ring and allgather (``context.balance`` from ``--balance``)
  torch    a plain-torch Llama-like stack of the same dims (benchmarks/cp_torch_ring.py):
           parameters replicated with one gradient all-reduce, the sequence split over a cp
           group of consecutive ranks and attention a hand-written ring of isend/irecv
           (online softmax over torch's CPU flash attention op, backward passing dK, dV
           around the ring), at cp=1 (plain SDPA), 2 and 4.  torchtitan's context parallel
           is not the peer: torch's ``context_parallel`` ring runs on CUDA attention ops only
           (docs/cp.md, Limits).  Before timing, its summed loss is checked against the same
           model's loss on one process over the whole batch (relative tolerance 1e-5, fp32), and its
           gradients summed over ranks against that process's (each parameter's largest
           difference within 1e-4 of its largest entry).

Measured per variant, the largest rank's (eager, in untimed steps):

  held     activation memory held at the end of forward: live tensor storage
           (meshlm.runtime.memory.PeakStorage, the tracker behind ``meshlm train``'s memory
           summary) minus what lived before the step (parameters, optimizer state);
  peak     the step's peak of the same, above what lived before the step;
  bytes    for meshlm, the attention's bytes on the cp axis per step
           (meshlm.runtime.comm.CommCounter: sends for ring, all-gathers and reduce-scatters
           for allgather, logical bytes) next to NOTE [cp attention]'s formula
           (meshlm/runtime/cp/ring.py) for ``layers`` calls with K the bytes of one layer's
           local keys (heads repeated, as Llama passes them to SDPA) and F = K (fp32); for
           the torch ring, the bytes its own isends posted.

The ring and allgather variants share equal meshes; each model's forward and backward run with
its own layout's context settings (NOTE [cp settings per model] in meshlm/runtime/cp/active.py).

Step time (forward, backward, optimizer step; the slowest rank's) is the median of ``--reps``
interleaved rounds after a warm-up step each.  Ratios: held memory over the no-cp run of the
same implementation; step time over the best peer at the same cp (the torch ring).

Writes DIR/cp_bench.json and DIR/cp_bench.md (default benchmarks/results/cp_bench/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3
MESHLM = [  # (name, layout, attention, mesh, cp)
    ("meshlm fsdp", "fsdp", None, "fsdp=4", 1),
    ("meshlm ring", "fsdp_cp", "ring", "fsdp=2,cp=2", 2),
    ("meshlm allgather", "fsdp_cp", "allgather", "fsdp=2,cp=2", 2),
    ("meshlm ring", "fsdp_cp", "ring", "cp=4", 4),
    ("meshlm allgather", "fsdp_cp", "allgather", "cp=4", 4),
]
TORCH_CPS = (1, 2, 4)


def _cp_layout(attention: str, balance: bool):
    """layouts/fsdp_cp.yaml with its context section set, built in memory on each rank.  (It
    was once a file every rank rewrote in one shared folder: a rank that read it while another
    had truncated it got an empty layout, hence the default ring attention, and waited in the
    allgather variant's first all-gather for a rank that was running the ring.)"""
    import yaml

    from meshlm.layout.rules import parse_layout

    path = ROOT / "layouts" / "fsdp_cp.yaml"
    data = yaml.safe_load(path.read_text())
    data["context"] = {"attention": attention, "balance": balance}
    name = f"fsdp_cp ({attention}, balance {balance})"
    return parse_layout(data, name=name, source=f"{path} with context.attention: {attention}")


def _tokens(cfg, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def _build_meshlm(cfg, layout, mesh_shape, cp, opts):
    import meshlm
    from meshlm.models import Llama
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=LR)
    X, Y = _tokens(cfg, opts["rows"] * 4 // cp, opts["seq"])
    x, y = meshlm.shard_batch((X, Y), layout, mesh)

    def fwd():
        return model(x, y)

    def step():
        fwd().backward()
        opt.step()
        opt.zero_grad()

    def cp_bytes():
        if cp == 1:
            return None
        cc = CommCounter(mesh)
        with cc:
            fwd().backward()
        opt.zero_grad()
        kinds = {"send", "all_gather", "reduce_scatter"}
        return sum(r.bytes for r in cc.records if r.axes == ("cp",) and r.kind in kinds)

    state = list(model.parameters()) + [v for s in opt.inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(fwd=fwd, step=step, zero=opt.zero_grad, state=state, cp_bytes=cp_bytes)


def _build_torch(cfg, cp, opts):
    import torch.distributed as dist

    import cp_torch_ring as tr

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + cp))) for i in range(0, world, cp)] if cp > 1 else None
    group = groups[rank // cp] if cp > 1 else None
    model = tr.RingLM(cfg.vocab, cfg.embed, cfg.layers, cfg.heads, cfg.kv_heads, cfg.mlp, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seq, rows, bal = opts["seq"], opts["rows"], opts["balance"]
    X, Y = _tokens(cfg, rows * world // cp, seq)
    d = rank // cp
    pos = tr.local_positions(seq, rank % cp, cp, bal) if cp > 1 else torch.arange(seq)
    x, y = X[d * rows : (d + 1) * rows][:, pos], Y[d * rows : (d + 1) * rows][:, pos]
    count = X.numel()

    def fwd():
        return model(x, y, pos, count, group, bal)

    def step():
        fwd().backward()
        tr.allreduce_grads(model)
        opt.step()
        opt.zero_grad()

    # the loss against one process over the whole batch, once, before timing
    with torch.no_grad():
        local = fwd().detach().reshape(1)
        dist.all_reduce(local)
        whole = model(X, Y, torch.arange(seq), count, None, bal)
    # every rank's token-loss sum over the global count, summed: the global mean
    dist_loss, one_loss = float(local), float(whole)
    rel = abs(dist_loss - one_loss) / abs(one_loss)
    if rel > 1e-5:
        raise AssertionError(
            f"torch ring cp={cp}: loss {dist_loss} differs from one process's {one_loss} (rel {rel:.2e})"
        )
    # and the gradients (summed over ranks) against one process's, relative to each one's largest entry
    fwd().backward()
    tr.allreduce_grads(model)
    got = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    model(X, Y, torch.arange(seq), count, None, bal).backward()
    grad_rel = max(float((g - p.grad).abs().max() / p.grad.abs().max()) for g, p in zip(got, model.parameters()))
    opt.zero_grad()
    if grad_rel > 1e-4:
        raise AssertionError(f"torch ring cp={cp}: gradients differ from one process's (max rel {grad_rel:.2e})")

    def cp_bytes():
        if cp == 1:
            return None
        tr.SENT[0] = 0
        fwd().backward()
        opt.zero_grad()
        return tr.SENT[0]

    return dict(fwd=fwd, step=step, zero=opt.zero_grad, state=list(model.parameters()), cp_bytes=cp_bytes,
                loss_check=dict(distributed=dist_loss, one_process=one_loss, rel=rel, grad_rel=grad_rel))  # fmt: skip


def _memory(v) -> tuple[float, float]:
    """(held at the end of forward, step peak), bytes above what lived before the step."""
    from harness.memory import PeakStorage

    mem = PeakStorage(v["state"])
    with mem:
        loss = v["fwd"]()
        held = mem.cur - mem.base
        loss.backward()
    del loss
    v["zero"]()
    return float(held), float(mem.peak - mem.base)


def _formula(cfg, opts, attention: str, cp: int) -> int:
    """The bytes per step for this rank by the formula of NOTE [cp attention] (meshlm/runtime/cp/ring.py): ``layers`` attention calls."""
    n = cp
    K = opts["rows"] * cfg.heads * (opts["seq"] // n) * cfg.hd * 4
    F = K
    per = 2 * (n - 1) * K + 2 * (n - 1) * K + 2 * n * F if attention == "ring" else 2 * n * K + 2 * n * K + 2 * n * F
    return cfg.layers * per


def _bench(opts: dict) -> dict:
    import torch.distributed as dist

    from bench_layouts import interleaved
    from meshlm.models import llama_config

    cfg = llama_config(opts["model"])
    variants, out = {}, {}
    for name, layout, attention, mesh_shape, cp in MESHLM:
        lay = layout if attention is None else _cp_layout(attention, opts["balance"])
        key = f"{name} cp={cp}"
        variants[key] = _build_meshlm(cfg, lay, mesh_shape, cp, opts)
        out[key] = dict(impl="meshlm", attention=attention, mesh=mesh_shape, cp=cp)
        if cp > 1:
            out[key]["formula_bytes"] = _formula(cfg, opts, attention, cp)
    for cp in TORCH_CPS:
        key = f"torch {'ring' if cp > 1 else 'sdpa'} cp={cp}"
        v = _build_torch(cfg, cp, opts)
        variants[key] = v
        out[key] = dict(impl="torch", attention="ring" if cp > 1 else None, mesh=f"dp={4 // cp},cp={cp}", cp=cp,
                        loss_check=v["loss_check"])  # fmt: skip
        if cp > 1:
            out[key]["formula_bytes"] = _formula(cfg, opts, "ring", cp)
    for key, v in variants.items():
        v["step"]()  # warm-up
        b = v["cp_bytes"]()
        dist.barrier()
        held, peak = _memory(v)
        t = torch.tensor([held, peak, float(b or 0)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[key].update(held_bytes=float(t[0]), peak_bytes=float(t[1]))
        if b is not None:
            out[key]["bytes"] = float(t[2])
    times = interleaved({k: v["step"] for k, v in variants.items()}, opts["reps"])
    for key, ts in times.items():
        out[key]["step_s"] = statistics.median(ts)
        out[key]["times"] = ts
    return out


def render(results: dict, meta: dict) -> str:
    base = {
        impl: next(r for r in results.values() if r["impl"] == impl and r["cp"] == 1) for impl in ("meshlm", "torch")
    }
    peer = {r["cp"]: r["step_s"] for r in results.values() if r["impl"] == "torch"}
    lines = [
        f"# Context parallel: meshlm against no cp and a hand-written torch ring, {meta['model']}, 4 CPU ranks",
        "",
        f"Measured {meta['date']} on {meta['machine']}, commit {meta['commit']}; torch {meta['torch']}; "
        f"`{meta['command']}`; load average (1, 5, 15 min) {meta['load_before']} before, {meta['load_after']} after.",
        f"seq {meta['seq']}, {meta['rows']} row(s) per rank (global batch rows x 4 / cp), fp32, SGD, "
        f"balance {meta['balance']}. Held: activation memory live at the end of forward, above the step's start "
        "(PeakStorage; the largest rank's). Peak: the step's peak above its start. Step: the slowest rank's, median "
        f"of {meta['reps']} interleaved rounds; ratio to the torch ring at the same cp. Bytes: the attention's bytes "
        "per step and rank on the cp group, measured and by NOTE [cp attention]'s formula.",
        "",
        "| variant | mesh | cp | held MiB | held / no cp | peak MiB | step s | step / torch ring | bytes measured | "
        "bytes formula | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        b0 = base[r["impl"]]["held_bytes"]
        has_b = "bytes" in r
        lines.append(
            f"| {key} | {r['mesh']} | {r['cp']} | {r['held_bytes'] / 2**20:.1f} | {r['held_bytes'] / b0:.2f}x | "
            f"{r['peak_bytes'] / 2**20:.1f} | {r['step_s']:.3f} | {r['step_s'] / peer[r['cp']]:.2f}x | "
            + (
                f"{int(r['bytes'])} | {r['formula_bytes']} | {'yes' if int(r['bytes']) == r['formula_bytes'] else 'NO'} |"
                if has_b
                else "| | |"
            )
        )
    checks = [f"{k}: {r['loss_check']['distributed']:.6f} vs {r['loss_check']['one_process']:.6f} (rel {r['loss_check']['rel']:.1e}), gradients max rel {r['loss_check']['grad_rel']:.1e}"
              for k, r in results.items() if "loss_check" in r]  # fmt: skip
    lines += [
        "",
        "Torch peer against one process, checked before timing (loss to 1e-5 relative, every gradient to 1e-4 of its "
        "largest entry): " + "; ".join(checks),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="meshlm context parallel vs no cp and a torch ring on 4 CPU ranks")
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1, help="sequences per rank (global batch rows * 4 / cp)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cp_bench"))
    args = ap.parse_args(argv)
    if args.seq % 8:
        raise SystemExit(f"--seq {args.seq}: must divide into 2*cp = 8 chunks (cp up to 4, balanced)")
    import run_meta

    opts = vars(args)
    return run_meta.run_and_write("cp_bench", _bench, opts, render, argv)


if __name__ == "__main__":
    sys.exit(main())
