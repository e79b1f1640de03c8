"""bf16 training memory, meshlm against torch, side by side, on 4 CPU ranks.

    python benchmarks/memory_floor.py [--layouts ddp,zero1,zero2,fsdp,hsdp] [--model llama_small]
                                      [--batch 8] [--seq 64] [--out DIR]

On one 4-rank gloo pool (meshlm.testing.DistPool), per layout, every rank builds the same
Llama (`--model`, same seed-0 weights, same global batch) under bf16 training with AdamW:
  meshlm  meshlm.shard(Llama(cfg, device="meta"), layout, mesh, **meshlm.train.shard_dtypes(
          TrainConfig(param_dtype="bfloat16"), layout, sizes)) + ShardedOptimizer(AdamW):
          the dtypes `meshlm train` uses (NOTE [mixed precision] in meshlm/precision.py)
  torch   benchmarks/baseline_llama.py (nn.Linear Llama loaded with the same weights):
            ddp    DDP(gradient_as_bucket_view=True) + torch.autocast("cpu", bfloat16) + AdamW
            zero1  the same + ZeroRedundancyOptimizer(AdamW)
            zero2  fully_shard(reshard_after_forward=False) per block and root, with
                   MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) + AdamW
            fsdp   fully_shard (as torchtitan: blocks reshard after forward, root does not),
                   same MixedPrecisionPolicy + AdamW
            hsdp   the fsdp variant on the 2-D ("dp", "fsdp") mesh
  (DDP buckets are the gradients' storage under gradient_as_bucket_view=True: the cheaper
  setting for torch, with no separate bucket copy of the gradients.)
torchtitan is not a column: its own layers are what baseline_llama.py reproduces, and it is
not installed in this environment (benchmarks/bench_layouts.py has the titan column when it is).

Each variant runs one warm-up step (AdamW's state exists after it), then one measured step
(forward, backward, opt.step(), opt.zero_grad()) in which every rank records:
- model state by kind, per rank, in bytes: each tensor's storage counted once, in this
  order of kinds: params (the module's parameters, local shards), grads (``.grad``,
  meshlm's ``main_grad`` and its masters' ``.grad``), master (meshlm's optimizer masters
  that do not share a parameter's storage) and adam (AdamW's exp_avg, exp_avg_sq, step),
  read after backward and after opt.step(); the table shows the larger total of the two;
- peak: the peak of live tensor storage over the step (PeakStorage from bench_layouts.py:
  the model state held at its start, plus every storage an op returns until it is freed:
  gathered parameters, casts, gradients, reduction buffers, activations, optimizer
  temporaries), the largest rank.  Not RSS: gloo's internal buffers and the Python heap
  are not counted.  Under DDP the gradient buckets, which the reducer keeps across steps,
  are counted from the start of the step.

Writes DIR/memory_floor.json and DIR/memory_floor.md (default benchmarks/results/memory_floor/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layouts import PeakStorage, _global_batch, write_report  # noqa: E402
from meshlm.testing.memory import local_data as _local  # noqa: E402
from meshlm.testing.memory import storage_bytes  # noqa: E402

LAYOUTS = {"ddp": {"dp": 4}, "zero1": {"dp": 4}, "zero2": {"dp": 4}, "fsdp": {"fsdp": 4},
           "hsdp": {"dp": 2, "fsdp": 2}}
TORCH = {
    "ddp": "DDP(gradient_as_bucket_view) + autocast bf16",
    "zero1": "DDP(gradient_as_bucket_view) + ZeroRedundancyOptimizer + autocast bf16",
    "zero2": "fully_shard(reshard_after_forward=False) + MixedPrecisionPolicy(bf16, fp32)",
    "fsdp": "fully_shard + MixedPrecisionPolicy(bf16, fp32)",
    "hsdp": "fully_shard on (dp, fsdp) + MixedPrecisionPolicy(bf16, fp32)",
}
RESULTS = Path(__file__).resolve().parent / "results" / "memory_floor"
LR = 1e-3
KINDS = ("params", "grads", "master", "adam")


def _kinds(params, grads, masters, adam) -> dict[str, int]:
    """Bytes by kind, each storage counted once (in the order of KINDS)."""
    seen: set[int] = set()

    def count(ts) -> int:
        return storage_bytes(ts, seen)

    out = {"params": count(params), "grads": count(grads), "master": count(masters), "adam": count(adam)}
    out["total"] = sum(out.values())
    return out


def _adam(inner) -> list:
    return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


class PhasePeak(PeakStorage):
    """PeakStorage that also records in which phase of the step (``phase``) the peak fell
    and, by the op that made each storage and its dtype, what was live at the peak."""

    phase = peak_phase = "start"

    def __init__(self, seed=()):
        self.made: dict[int, str] = {}
        self.op = "state at the start"
        self.at_peak: dict[str, int] = {}
        super().__init__(seed)

    def _track(self, t) -> None:
        before = len(self.live)
        super()._track(t)
        if len(self.live) > before:
            key = next(reversed(self.live))
            self.made[key] = f"{self.op} {str(_local(t).dtype).replace('torch.', '')}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func.__name__
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.peak_phase = self.phase
            self.at_peak = {}
            for key, n in self.sizes.items():
                if n:
                    k = self.made.get(key, "?")
                    self.at_peak[k] = self.at_peak.get(k, 0) + n
        return out

    def top(self, k: int = 6) -> list:
        return sorted(self.at_peak.items(), key=lambda kv: -kv[1])[:k]


# --------------------------------------------------------------------------- builders
def _build_meshlm(cfg, layout, sizes, X, Y):
    import meshlm
    from meshlm.config import TrainConfig
    from meshlm.models import Llama
    from meshlm.optim import ShardedOptimizer
    from meshlm.train import shard_dtypes

    mesh = meshlm.make_mesh(sizes)
    dtypes = shard_dtypes(TrainConfig(param_dtype="bfloat16"), meshlm.load_layout(layout), sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, **dtypes)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=LR)
    x, y = meshlm.shard_batch(X, layout, mesh), meshlm.shard_batch(Y, layout, mesh)
    params = list(model.parameters())

    def fwd():
        return model(x, y)

    def kinds():
        return _kinds(params, [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
                      + [m.grad for m in opt.masters().values()], opt.masters().values(), _adam(opt.inner))

    def state():
        return params + list(opt.masters().values()) + _adam(opt.inner)

    return dict(fwd=fwd, opt=opt, kinds=kinds, state=state,
                dtypes={k: str(v) for k, v in dtypes.items()},
                param_dtypes=sorted({str(p.dtype) for p in params}))


def _build_torch(cfg, layout, sizes, X, Y):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    import baseline_llama as bl
    from meshlm.models import Llama

    names = tuple(sizes)
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=names)
    model = bl.load_from_meshlm(bl.BaselineLlama(cfg), Llama(cfg, seed=0))
    ddp = layout in ("ddp", "zero1")
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, gradient_as_bucket_view=True)
        if layout == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        dp_mesh = mesh[("dp", "fsdp")] if layout == "hsdp" else mesh
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        bl.apply_fsdp(model, dp_mesh, reshard_after_forward=layout != "zero2", mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n_dp, dp_rank = 1, 0
    for a in ("dp", "fsdp"):
        if a in names:
            n_dp, dp_rank = n_dp * sizes[a], dp_rank * sizes[a] + mesh[a].get_local_rank()
    b = X.shape[0] // n_dp
    x, y = X[dp_rank * b:(dp_rank + 1) * b], Y[dp_rank * b:(dp_rank + 1) * b]
    params = list(model.parameters())
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local AdamW

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16) if ddp else nullcontext():
            logits = model(x)
        return bl.loss_fn(logits, y)

    def kinds():
        return _kinds(params, [p.grad for p in params], [], _adam(inner))

    def state():
        return params + _adam(inner)

    return dict(fwd=fwd, opt=opt, kinds=kinds, state=state, ddp=ddp, params=params,
                param_dtypes=sorted({str(p.dtype) for p in params}))


BUILDERS = {"meshlm": _build_meshlm, "torch": _build_torch}


# --------------------------------------------------------------------------- one layout
def _bench_layout(layout, sizes, opts):
    """Runs on every rank; returns this rank's measurements."""
    import torch.distributed as dist

    from meshlm.models import llama_config

    torch.manual_seed(0)
    cfg = llama_config(opts["model"])
    X, Y = _global_batch(cfg, opts["batch"], opts["seq"])
    out: dict = {}
    for impl, build in BUILDERS.items():
        v = build(cfg, layout, sizes, X, Y)
        opt = v["opt"]
        loss = v["fwd"]()  # warm-up: AdamW's state, DDP's rebuilt buckets
        loss.backward()
        loss0 = float(loss.detach())
        del loss
        persistent = [p.grad for p in v["params"]] if v.get("ddp") else []  # the reducer's buckets
        opt.step()
        opt.zero_grad()
        dist.barrier()
        seed = v["state"]() + [g for g in persistent if g is not None]
        mem = PhasePeak(seed)
        with mem:
            mem.phase = "forward"
            loss = v["fwd"]()
            mem.phase = "backward"
            loss.backward()
            del loss
            after_bwd = v["kinds"]()
            mem.phase = "optimizer"
            opt.step()
            after_step = v["kinds"]()
            opt.zero_grad()
        dist.barrier()
        state = max((after_bwd, after_step), key=lambda k: k["total"])
        out[impl] = dict(loss0=loss0, after_backward=after_bwd, after_step=after_step, state=state,
                         peak_bytes=mem.peak, peak_phase=mem.peak_phase, at_peak=mem.top(), start_bytes=mem.base, param_dtypes=v["param_dtypes"],
                         **({"shard_dtypes": v["dtypes"]} if "dtypes" in v else {}))
        del v, opt, mem, persistent, seed
    return out


def _elements(cfg) -> int:
    from meshlm.models import Llama

    return sum(p.numel() for p in Llama(cfg, device="meta").parameters())


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(results: dict, meta: dict) -> str:
    n = meta["parameters"]
    lines = [
        f"# bf16 training memory per rank: meshlm vs torch ({meta['date']})",
        "",
        f"`{meta['command']}`: {meta['model']} ({n:,} parameters), global batch {meta['batch']} x seq "
        f"{meta['seq']}, 4 gloo ranks, AdamW, one measured step after one warm-up; {meta['machine']}, "
        f"torch {meta['torch']}; torchtitan {meta['torchtitan']}; {meta['wall_s']} s.",
        "",
        "Model state (MiB per rank, the larger of after-backward and after-step, largest rank; "
        "params / grads / master / adam = AdamW's state) and peak live tensor storage over the "
        "step (MiB, largest rank, activations included; in: the phase of the step where it fell). "
        "B/P = model-state bytes per parameter; m/t = meshlm / torch.",
        "",
        "| layout | mesh | impl | params | grads | master | adam | state | B/P | state m/t | peak | in | peak m/t |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for lay, r in results.items():
        if "error" in r:
            lines.append(f"| {lay} | {r['mesh']} | error | {r['error']} ||||||||||")
            continue
        m, t = r["meshlm"], r["torch"]
        for impl, x in (("meshlm", m), ("torch", t)):
            s = x["state"]
            first = impl == "meshlm"
            lines.append(
                f"| {lay if first else ''} | {r['mesh'] if first else ''} | {impl} | "
                + " | ".join(_mb(s[k]) for k in KINDS)
                + f" | {_mb(s['total'])} | {s['total'] / n:.2f} | "
                + (_ratio(m["state"]["total"], t["state"]["total"]) if first else "")
                + f" | {_mb(x['peak_bytes'])} | {x['peak_phase']} | "
                + (_ratio(m["peak_bytes"], t["peak_bytes"]) if first else "") + " |")
    lines += ["", "torch variants: " + "; ".join(f"{k}: {v}" for k, v in TORCH.items() if k in results) + ".",
              "meshlm dtypes (`meshlm.train.shard_dtypes`): "
              + "; ".join(f"{k}: params {r['meshlm']['param_dtypes']}, {r['meshlm']['shard_dtypes']}"
                          for k, r in results.items() if "meshlm" in r) + "."]
    lines += ["", "Warm-up losses (same seed-0 weights; meshlm's is the global batch's mean, torch's rank 0's "
              "local batch's): "
              + "; ".join(f"{k} meshlm {r['meshlm']['loss0']:.4f} torch {r['torch']['loss0']:.4f}"
                          for k, r in results.items() if "meshlm" in r) + "."]
    lines += ["", "Live at the peak (largest rank), MiB by the op that made each storage and its dtype "
              "(`state at the start`: parameters, masters, AdamW state, DDP's buckets):", ""]
    for k, r in results.items():
        for impl in BUILDERS:
            if impl in r:
                lines.append(f"- {k} {impl}: " + ", ".join(f"{op} {_mb(n)}" for op, n in r[impl]["at_peak"]))
    lines.append("")
    for note in meta["notes"]:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--model", default="llama_small")
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    for lay in layouts:
        if lay not in LAYOUTS:
            ap.error(f"unknown layout {lay!r}; choose from {', '.join(LAYOUTS)}")

    import titan_llama
    from meshlm.models import llama_config
    from meshlm.testing.dist import DistPool

    why = titan_llama.available()
    notes = [f"torchtitan: not a column ({'not installed: ' + why if why else 'installed, not used here'})"]
    opts = dict(vars(args))
    results: dict = {}
    t_start = time.time()
    with DistPool(4, timeout_s=300, job_timeout_s=1800) as pool:
        for lay in layouts:
            t0 = time.time()
            try:
                per_rank = pool.run(_bench_layout, lay, LAYOUTS[lay], opts)
                r = dict(per_rank[0])
                for impl in BUILDERS:  # the largest rank
                    top = max(per_rank, key=lambda p: p[impl]["peak_bytes"])
                    for k in ("peak_bytes", "peak_phase", "at_peak"):
                        r[impl][k] = top[impl][k]
                    r[impl]["state"] = max((p[impl]["state"] for p in per_rank), key=lambda k: k["total"])
            except Exception as e:  # noqa: BLE001 - one failed layout must not sink the table
                tb = getattr(e, "remote_traceback", "") or ""
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                              + (f" ({tb.strip().splitlines()[-1][:300]})" if tb.strip() else "")}
            r["mesh"] = LAYOUTS[lay]
            results[lay] = r
            if "error" in r:
                print(f"[{lay}] {time.time() - t0:.0f}s error {r['error']}", flush=True)
            else:
                print(f"[{lay} {LAYOUTS[lay]}] {time.time() - t0:.0f}s state meshlm {r['meshlm']['state']} "
                      f"torch {r['torch']['state']} peak meshlm {r['meshlm']['peak_bytes']} "
                      f"torch {r['torch']['peak_bytes']}", flush=True)
    cfg = llama_config(args.model)
    meta = dict(date=datetime.date.today().isoformat(),
                command=("python benchmarks/memory_floor.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip(),
                machine=f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}",
                torch=torch.__version__, torchtitan="not installed" if why else "installed (not used)",
                model=args.model, parameters=_elements(cfg), batch=args.batch, seq=args.seq,
                wall_s=round(time.time() - t_start), notes=notes)
    write_report(Path(args.out), "memory_floor", {"meta": meta, "results": results}, render(results, meta),
                 meta["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
