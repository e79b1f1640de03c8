"""meshlm's mixture-of-experts layer under fsdp, fsdp_ep and tp x ep against a hand-written
torch all-to-all MoE, on 4 CPU ranks.

    python benchmarks/moe_bench.py [--model moe_small] [--layers N] [--batch 8] [--seq 128]
                                   [--reps 3] [--out DIR]

The model is a stack of ``--layers`` residual MoE layers (meshlm.nn.MoE) with ``--model``'s
expert dims (embed, experts, top_k, expert_mlp, capacity_factor; conf/model/moe_*.yaml) and a
mean-squared-error loss, fp32, SGD, ``--batch`` sequences of ``--seq`` tokens in all.  The
attention, norms and head of the MoE transformer are left out: they are Llama's, measured in
the other benchmarks, and the peer would only repeat them.  The auxiliary losses are off
(weights 0) on both sides.

  meshlm   layouts ``fsdp`` on fsdp=4, ``fsdp_ep`` on fsdp=2 x ep=2 and on ep=4, and
           ``fsdp_tp_ep`` on tp=2 x ep=2 (its own mesh, fsdp2_tp2_ep2, needs 8 ranks; fsdp=1
           here), each layout's rules for the axes this model has (batch, embed, mlp,
           experts), built in memory.
  torch    benchmarks/moe_torch_a2a.py: the same routing and dense dispatch (GShard's, as
           DeepSpeed-MoE runs it), experts split over an ep group of consecutive ranks and
           exchanged by two ``all_to_all_single`` per layer (gloo runs all-to-all on the
           CPU), the router and the experts' replicas reduced by one flat all-reduce each;
           at ep=1 (every rank every expert), 2 and 4.

Before timing, every variant's loss and gradients on the same weights are checked against
the torch stack on one process over the whole batch (loss to 1e-5 relative, each parameter's
gradient to 1e-4 of its largest entry): the comparison is of the same math.

Measured per variant (the largest rank's): ``bytes``, the wire bytes of every collective of
one step (forward, backward, optimizer step; meshlm: CommCounter's wire bytes, the peer: its
own count by the same ring factors), and of its all-to-alls alone; ``peak``, the step's peak
of live tensor storage (PeakStorage), parameters and optimizer state included; ``step``, the
slowest rank's step time, the median of ``--reps`` interleaved rounds after a warm-up.  Ratios
to the torch peer at the same ep (ep=1 for fsdp).

Writes DIR/moe_bench.json and DIR/moe_bench.md (default benchmarks/results/moe_bench/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3
AXES = {"batch", "embed", "mlp", "experts"}
MESHLM = [  # (name, layout, mesh, ep of the peer it is compared with)
    ("meshlm fsdp", "fsdp", "fsdp=4", 1),
    ("meshlm fsdp_ep", "fsdp_ep", "fsdp=2,ep=2", 2),
    ("meshlm fsdp_ep", "fsdp_ep", "ep=4", 4),
    ("meshlm fsdp_tp_ep", "fsdp_tp_ep", "tp=2,ep=2", 2),
]
TORCH_EPS = (1, 2, 4)


class MoEStack(nn.Module):
    """``layers`` residual meshlm MoE layers and a mean-squared-error loss."""

    param_axes: ClassVar[dict] = {}

    def __init__(self, embed, mlp, experts, top_k, layers, capacity_factor, norm_topk, device=None):
        super().__init__()
        from meshlm.core.moe import MoE

        self.layers = nn.ModuleList(
            MoE(embed, mlp, experts, top_k, capacity_factor=capacity_factor, norm_topk=norm_topk, device=device)
            for _ in range(layers)
        )

    def init_weights(self, gen: torch.Generator) -> None:  # no parameters of its own
        pass

    def forward(self, x, y):  # x, y: (batch, seq, embed)
        from meshlm.core.annotate import constrain, reduce_batch

        x = constrain(x, ("batch", None, "embed"))
        for m in self.layers:
            x = x + m(x)[0]
        return reduce_batch(F.mse_loss(x, y), "mean")  # every rank holds as many rows


def _layout(name: str):
    """layouts/<name>.yaml with the rules for this model's axes only (a layout naming an axis
    the model never uses is refused)."""
    import yaml

    from meshlm.layout.rules import parse_layout

    path = ROOT / "layouts" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    data = {sec: {a: m for a, m in rules.items() if a in AXES} for sec, rules in data.items()}
    return parse_layout(data, name=name, source=f"{path} (batch, embed, mlp and experts rules)")


def _dims(opts):
    from meshlm.models.moe import moe_config

    c = moe_config(opts["model"])
    layers = opts["layers"] or c.layers
    return dict(embed=c.embed, mlp=c.expert_mlp, experts=c.experts, top_k=c.top_k, layers=layers,
                capacity_factor=c.capacity_factor, norm_topk=c.norm_topk)  # fmt: skip


def _data(opts, embed):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(opts["batch"], opts["seq"], embed, generator=g)
    Y = torch.randn(opts["batch"], opts["seq"], embed, generator=g)
    return X, Y


def _reference(dims, full, X, Y):
    """The torch stack on one process over the whole batch, with the weights ``full``:
    (loss, {name: grad})."""
    import moe_torch_a2a as ta

    ref = ta.MoEStack(dims["embed"], dims["mlp"], dims["experts"], dims["top_k"], dims["layers"],
                      dims["capacity_factor"])  # fmt: skip
    for i, m in enumerate(ref.layers):
        m.load({k: full[f"layers.{i}.{k}"] for k in ("router", "w_gate", "w_up", "w_down")})
    loss = ref(X, Y, X.numel())
    loss.backward()
    return float(loss), {n: p.grad for n, p in ref.named_parameters()}


def _compare(loss, grads, ref_loss, ref_grads) -> dict:
    """The loss and the gradients against one process's: relative differences, the largest
    gradient's scale against the reference's, and whether both are within tolerance."""
    rel = abs(loss - ref_loss) / abs(ref_loss)
    grad_rel = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in ref_grads.items())
    scale = max(float(grads[n].abs().max() / g.abs().max()) for n, g in ref_grads.items())
    return dict(loss=loss, one_process=ref_loss, rel=rel, grad_rel=grad_rel, grad_scale=scale,
                ok=rel <= 1e-5 and grad_rel <= 1e-4)  # fmt: skip


def _build_meshlm(name, layout, mesh_shape, dims, opts):
    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_shape)
    lay = _layout(layout)
    model = meshlm.shard(MoEStack(**dims, device="meta"), lay, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=LR)
    X, Y = _data(opts, dims["embed"])
    x, y = meshlm.shard_batch((X, Y), lay, mesh)

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    # the same math: loss and the gradients the optimizer steps with, against one process
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    loss = model(x, y)
    loss.backward()
    opt.reduce_grads()
    grads = {n: m.grad.full_tensor() for n, m in opt.masters().items()}
    opt.zero_grad()
    check = _compare(float(loss.detach()), grads, *_reference(dims, full, X, Y))

    def comm():
        cc = CommCounter(mesh)
        with cc:
            step()
        return (sum(r.wire_bytes for r in cc.records),
                sum(r.wire_bytes for r in cc.records if r.kind == "all_to_all"))  # fmt: skip

    state = list(model.parameters()) + [v for s in opt.inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(step=step, comm=comm, state=state, check=check, full=full)


def _build_torch(ep, dims, opts, full):
    import torch.distributed as dist

    import moe_torch_a2a as ta

    world, rank = dist.get_world_size(), dist.get_rank()
    eps = [dist.new_group(list(range(i, i + ep))) for i in range(0, world, ep)]  # every rank makes every group
    dps = [dist.new_group(list(range(j, world, ep))) for j in range(ep)]
    group, dp = eps[rank // ep], (dps[rank % ep] if world > ep else None)
    model = ta.MoEStack(dims["embed"], dims["mlp"], dims["experts"], dims["top_k"], dims["layers"],
                        dims["capacity_factor"], n=ep, r=rank % ep)  # fmt: skip
    # meshlm's initial weights (``full``, gathered from a meshlm variant)
    for i, m in enumerate(model.layers):
        m.load({k: full[f"layers.{i}.{k}"] for k in ("router", "w_gate", "w_up", "w_down")})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    X, Y = _data(opts, dims["embed"])
    rows = opts["batch"] // world
    x, y = X[rank * rows : (rank + 1) * rows], Y[rank * rows : (rank + 1) * rows]
    count = X.numel()

    def step():
        model(x, y, count, group).backward()
        ta.allreduce_grads(model, None, dp)
        opt.step()
        opt.zero_grad()

    # loss and gradients (whole, gathered over the ep group) against one process
    loss = model(x, y, count, group)
    loss.backward()
    ta.allreduce_grads(model, None, dp)
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if ep > 1 and not n.endswith("router"):
            parts = [torch.empty_like(g) for _ in range(ep)]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts)
        grads[n] = g
    opt.zero_grad()
    check = _compare(float(total), grads, *_reference(dims, full, X, Y))
    if not check["ok"]:
        raise AssertionError(f"torch peer ep={ep} differs from one process: {check}")

    def comm():
        ta.SENT[0] = 0.0
        a2a = [0.0]
        orig = ta._a2a

        def counted(t, g):
            before = ta.SENT[0]
            out = orig(t, g)
            a2a[0] += ta.SENT[0] - before
            return out

        ta._a2a = counted
        try:
            step()
        finally:
            ta._a2a = orig
        return ta.SENT[0], a2a[0]

    return dict(step=step, comm=comm, state=list(model.parameters()), check=check)


def _peak(v) -> float:
    """The step's peak of live tensor storage, the state held before it included."""
    from harness.memory import PeakStorage

    mem = PeakStorage(v["state"])
    with mem:
        v["step"]()
    return float(mem.peak)


def _bench(opts: dict) -> dict:
    import torch.distributed as dist

    from bench_layouts import interleaved

    dims = _dims(opts)
    variants, out, full = {}, {}, None
    for name, layout, mesh_shape, ep in MESHLM:
        key = f"{name} {mesh_shape}"
        v = _build_meshlm(name, layout, mesh_shape, dims, opts)
        out[key] = dict(impl="meshlm", layout=layout, mesh=mesh_shape, ep=ep, check=v["check"])
        full = v["full"] if full is None else full
        if v["check"]["ok"]:  # a variant that is not the same math is reported, not timed
            variants[key] = v
    for ep in TORCH_EPS:
        key = f"torch a2a ep={ep}"
        variants[key] = _build_torch(ep, dims, opts, full)
        out[key] = dict(impl="torch", layout=None, mesh=f"dp={4 // ep},ep={ep}", ep=ep, check=variants[key]["check"])
    for key, v in variants.items():
        v["step"]()  # warm-up
        total, a2a = v["comm"]()
        dist.barrier()
        peak = _peak(v)
        t = torch.tensor([total, a2a, peak], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[key].update(bytes=float(t[0]), a2a_bytes=float(t[1]), peak_bytes=float(t[2]))
    times = interleaved({k: v["step"] for k, v in variants.items()}, opts["reps"])
    for key, ts in times.items():
        out[key]["step_s"] = statistics.median(ts)
        out[key]["times"] = ts
    return out


def render(results: dict, meta: dict) -> str:
    peer = {r["ep"]: r for r in results.values() if r["impl"] == "torch"}
    d = meta["dims"]
    lines = [
        f"# Mixture of experts: meshlm against a hand-written torch all-to-all MoE, {meta['model']} experts, 4 CPU ranks",
        "",
        f"Measured {meta['date']} on {meta['machine']}, commit {meta['commit']}; torch {meta['torch']}; "
        f"`{meta['command']}`; load average (1, 5, 15 min) {meta['load_before']} before, {meta['load_after']} after.",
        f"{d['layers']} residual MoE layers: embed {d['embed']}, {d['experts']} experts of width {d['mlp']}, top-{d['top_k']}, "
        f"capacity factor {d['capacity_factor']} (None: dropless, capacity = seq); batch {meta['batch']} x seq "
        f"{meta['seq']} in all; fp32, SGD. Bytes: wire bytes of one step's collectives (all; all-to-alls). Peak: "
        "the step's peak of live tensor storage, state included (PeakStorage). Step: the slowest rank's, median of "
        f"{meta['reps']} interleaved rounds. Ratios to the torch peer at the same ep (ep=1 for fsdp). The largest "
        "rank's figures.",
        "",
        "| variant | mesh | MiB moved | of it all-to-all | / peer | peak MiB | / peer | step s | / peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        p = peer[r["ep"]]
        if "step_s" not in r:
            c = r["check"]
            lines.append(
                f"| {key} | {r['mesh']} | not timed: its gradients are {c['grad_scale']:.2f}x one process's "
                f"(max rel difference {c['grad_rel']:.2e}; loss rel {c['rel']:.1e}) | | | | | | |"
            )
            continue
        lines.append(
            f"| {key} | {r['mesh']} | {r['bytes'] / 2**20:.2f} | {r['a2a_bytes'] / 2**20:.2f} | "
            f"{r['bytes'] / p['bytes'] if p['bytes'] else float('nan'):.2f}x | {r['peak_bytes'] / 2**20:.1f} | "
            f"{r['peak_bytes'] / p['peak_bytes']:.2f}x | {r['step_s']:.3f} | {r['step_s'] / p['step_s']:.2f}x |"
        )
    checks = [f"{k}: rel {r['check']['rel']:.1e}, gradients {r['check']['grad_rel']:.1e}" for k, r in results.items()
              if r["check"]["ok"]]  # fmt: skip
    lines += [
        "",
        "Against the torch stack on one process over the whole batch, same weights, before timing (loss to 1e-5 "
        "relative, each gradient to 1e-4 of its largest entry): " + "; ".join(checks),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="meshlm MoE under fsdp / ep layouts vs a torch all-to-all MoE, 4 ranks")
    ap.add_argument("--model", default="moe_small", help="an MoE config of conf/model/ (its expert dims)")
    ap.add_argument("--layers", type=int, default=0, help="MoE layers (0: the model's)")
    ap.add_argument("--batch", type=int, default=8, help="sequences in all (a multiple of 4)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_bench"))
    args = ap.parse_args(argv)
    if args.batch % 4:
        raise SystemExit(f"--batch {args.batch}: must be a multiple of 4 (one share per rank)")
    import run_meta

    opts = vars(args)
    return run_meta.run_and_write("moe_bench", _bench, opts, render, argv, dims=_dims(opts))


if __name__ == "__main__":
    sys.exit(main())
