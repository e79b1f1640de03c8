"""bf16 training memory, meshlm against torch and torchtitan, side by side, on 4 CPU ranks.

    python benchmarks/memory_floor.py [--layouts ddp,zero1,zero2,fsdp,hsdp] [--model llama_small]
                                      [--batch 8] [--seq 64] [--out DIR]

On one 4-rank gloo pool (harness.DistPool), per layout, every rank builds the same
Llama (`--model`, same seed-0 weights, same global batch) under bf16 training with AdamW:
  meshlm  meshlm.shard(Llama(cfg, device="meta"), layout, mesh, **meshlm.app.train.shard_dtypes(
          TrainConfig(param_dtype="bfloat16"), layout, sizes)) + ShardedOptimizer(AdamW):
          the dtypes `meshlm train` uses (NOTE [mixed precision] in meshlm/layout/precision.py)
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
  titan   torchtitan 0.3.0's own Llama 3 and parallelize_llama (benchmarks/titan_llama.py),
          under its bf16 training config: TrainingConfig(mixed_precision_param="bfloat16",
          mixed_precision_reduce="float32"), which it applies as FSDP2's
          MixedPrecisionPolicy(bf16, fp32, cast_forward_inputs=False) on every layout, with
          meshlm's seed-0 weights loaded (titan_llama.load_meshlm_weights), AdamW, and its
          trainer's loss (sum over the global token count; FSDP's gradient division off):
            ddp    data_parallel_replicate_degree=4: fully_shard on the (dp_replicate=4,
                   fsdp=1) mesh (0.3.0 has no DDP wrapper; its replicate degree is this)
            zero2  data_parallel_shard_degree=4, fsdp_reshard_after_forward="never" (the
                   setting the torch zero2 column uses; torchtitan has no ZeRO-2 that keeps
                   parameters whole between steps, and no ZeRO-1)
            fsdp   data_parallel_shard_degree=4 (fsdp_reshard_after_forward="default")
            hsdp   data_parallel_replicate_degree=2, data_parallel_shard_degree=2
          Only when torchtitan can be imported (`pip install -e .[bench]`); otherwise the
          column is left out and the report says why.

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
  are counted from the start of the step.  What was live at the peak, by the op that made
  each storage and its dtype;
- the peak less gloo's reduce-scatter buffer (PhasePeak.peak_less_gloo): c10d's gloo
  reduce-scatter, which FSDP2 calls, keeps a copy of its whole input live that NCCL does not
  make and that meshlm's functional collectives hide inside their op; this peak compares
  both sides without it.

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

# this folder (the benchmarks import each other) and tests/ (the multi-process harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_layouts import PeakStorage, _global_batch, write_report  # noqa: E402
from harness.memory import local_data as _local  # noqa: E402
from harness.memory import storage_bytes  # noqa: E402

LAYOUTS = {"ddp": {"dp": 4}, "zero1": {"dp": 4}, "zero2": {"dp": 4}, "fsdp": {"fsdp": 4}, "hsdp": {"dp": 2, "fsdp": 2}}
TORCH = {
    "ddp": "DDP(gradient_as_bucket_view) + autocast bf16",
    "zero1": "DDP(gradient_as_bucket_view) + ZeroRedundancyOptimizer + autocast bf16",
    "zero2": "fully_shard(reshard_after_forward=False) + MixedPrecisionPolicy(bf16, fp32)",
    "fsdp": "fully_shard + MixedPrecisionPolicy(bf16, fp32)",
    "hsdp": "fully_shard on (dp, fsdp) + MixedPrecisionPolicy(bf16, fp32)",
}
# torchtitan 0.3.0 per layout: (titan_llama.STRATEGIES key, its mesh, fsdp_reshard_after_forward);
# zero1: none
TITAN = {
    "ddp": ("ddp", {"dp": 4}, "default"),
    "zero2": ("fsdp", {"fsdp": 4}, "never"),
    "fsdp": ("fsdp", {"fsdp": 4}, "default"),
    "hsdp": ("hsdp", {"dp": 2, "fsdp": 2}, "default"),
}
TITAN_TEXT = {
    "ddp": "data_parallel_replicate_degree=4 (fully_shard on the (4, 1) mesh)",
    "zero2": "data_parallel_shard_degree=4, fsdp_reshard_after_forward=never",
    "fsdp": "data_parallel_shard_degree=4",
    "hsdp": "data_parallel_replicate_degree=2, data_parallel_shard_degree=2",
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
    and, by the op that made each storage and its dtype, what was live at the peak.

    ``peak_less_gloo``: the same peak less gloo's reduce-scatter buffer.  On gloo, c10d's
    ``reduce_scatter_tensor`` (FSDP2's: torch's and torchtitan's columns) allocates a buffer the
    size of its whole input, first seen here through the ``split.Tensor`` that follows
    ``_reduce_scatter_base_``, and it stays live after the call (FSDP2 holds the collective's
    state until the next one).  meshlm's functional reduce-scatter runs on the same backend,
    but whatever it allocates is allocated inside the collective's op, below this mode, and
    never counted.  The peak less that buffer compares both sides without it, as on a backend
    with a native reduce-scatter (NCCL)."""

    phase = peak_phase = "start"
    GLOO_RS = ("_reduce_scatter_base_.default", "split.Tensor")  # (the collective, the op that shows its copy)

    def __init__(self, seed=()):
        self.made: dict[int, str] = {}
        self.op = self.prev = "state at the start"
        self.at_peak: dict[str, int] = {}
        self.gloo: set[int] = set()  # live storages of gloo's reduce-scatter copy
        self.gloo_at_peak = 0
        super().__init__(seed)
        self.peak_less_gloo = self.cur
        self.less_gloo_phase = "start"
        self.at_peak_less_gloo: dict[str, int] = {}

    def _track(self, t) -> None:
        before = len(self.live)
        super()._track(t)
        if len(self.live) > before:
            key = next(reversed(self.live))
            self.made[key] = f"{self.op} {str(_local(t).dtype).replace('torch.', '')}"
            if (self.prev, self.op) == self.GLOO_RS:
                self.gloo.add(key)

    def _free(self, key: int) -> None:
        self.gloo.discard(key)  # the key (an address) may be reused by a later storage
        super()._free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.prev, self.op = self.op, func.__name__
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        gloo = sum(self.sizes.get(k, 0) for k in list(self.gloo))
        if self.cur - gloo > self.peak_less_gloo:
            self.peak_less_gloo = self.cur - gloo
            self.less_gloo_phase = self.phase
            self.at_peak_less_gloo = self._live(exclude=set(self.gloo))
        if self.peak > before:
            self.peak_phase = self.phase
            self.gloo_at_peak = gloo
            self.at_peak = self._live()
        return out

    def _live(self, exclude=frozenset()) -> dict[str, int]:
        """Live bytes by the op that made each storage and its dtype."""
        live: dict[str, int] = {}
        # a copy: a storage's finalizer (PeakStorage._free) may run during the loop
        for key, n in self.sizes.copy().items():
            if n and key not in exclude:
                k = self.made.get(key, "?")
                live[k] = live.get(k, 0) + n
        return live

    def top(self, k: int | None = 6) -> list:
        """What was live at the peak, largest first (``k`` of them; all for None)."""
        return sorted(self.at_peak.items(), key=lambda kv: -kv[1])[:k]


# --------------------------------------------------------------------------- builders
def _build_meshlm(cfg, layout, sizes, X, Y):
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.app.train import shard_dtypes
    from meshlm.models import Llama
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(sizes)
    dtypes = shard_dtypes(TrainConfig(param_dtype="bfloat16"), meshlm.load_layout(layout), sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, **dtypes)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=LR)
    x, y = meshlm.shard_batch(X, layout, mesh), meshlm.shard_batch(Y, layout, mesh)
    params = list(model.parameters())

    def fwd():
        return model(x, y)

    def kinds():
        return _kinds(
            params,
            [p.grad for p in params]
            + [getattr(p, "main_grad", None) for p in params]
            + [m.grad for m in opt.masters().values()],
            opt.masters().values(),
            _adam(opt.inner),
        )

    def state():
        return params + list(opt.masters().values()) + _adam(opt.inner)

    return dict(
        fwd=fwd,
        opt=opt,
        kinds=kinds,
        state=state,
        dtypes={k: str(v) for k, v in dtypes.items()},
        param_dtypes=sorted({str(p.dtype) for p in params}),
    )


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
    x, y = X[dp_rank * b : (dp_rank + 1) * b], Y[dp_rank * b : (dp_rank + 1) * b]
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

    return dict(
        fwd=fwd,
        opt=opt,
        kinds=kinds,
        state=state,
        ddp=ddp,
        params=params,
        param_dtypes=sorted({str(p.dtype) for p in params}),
    )


def _build_titan(cfg, layout, sizes, X, Y):
    import titan_llama
    from meshlm.models import Llama

    strategy, titan_sizes, reshard = TITAN[layout]
    assert titan_sizes == sizes or layout == "zero2", (layout, sizes, titan_sizes)
    p = titan_llama.build_parts(
        cfg,
        strategy,
        titan_sizes,
        X.shape[1],
        None,
        LR,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        reshard=reshard,
        weights=Llama(cfg, seed=0),
    )
    model, opt = p["model"], p["opt"]
    x, y = p["shard"](X), p["shard"](Y)
    params = list(model.parameters())

    def fwd():
        return p["loss"](x, y)

    def kinds():
        return _kinds(params, [q.grad for q in params], [], _adam(opt))

    def state():
        return params + _adam(opt)

    return dict(
        fwd=fwd,
        opt=opt,
        kinds=kinds,
        state=state,
        loss_scale=p["n_dp"],
        param_dtypes=sorted({str(q.dtype) for q in params}),
    )


BUILDERS = {"meshlm": _build_meshlm, "torch": _build_torch, "titan": _build_titan}


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
        if impl == "titan" and not (opts["titan"] and layout in TITAN):
            continue
        try:
            out[impl] = _measure(build(cfg, layout, sizes, X, Y))
        except Exception as e:  # noqa: BLE001 - torchtitan failing must not sink meshlm and torch
            if impl != "titan":
                raise
            out[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        dist.barrier()
    return out


def _measure(v) -> dict:
    """One warm-up step, then one measured step of the variant ``v`` (a builder's dict)."""
    import torch.distributed as dist

    opt = v["opt"]
    loss = v["fwd"]()  # warm-up: AdamW's state, DDP's rebuilt buckets
    loss.backward()
    loss0 = float(loss.detach()) * v.get("loss_scale", 1)  # the local mean
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
    return dict(
        loss0=loss0,
        after_backward=after_bwd,
        after_step=after_step,
        state=state,
        peak_bytes=mem.peak,
        peak_phase=mem.peak_phase,
        at_peak=mem.top(None),
        start_bytes=mem.base,
        peak_less_gloo=mem.peak_less_gloo,
        gloo_rs_at_peak=mem.gloo_at_peak,
        less_gloo_phase=mem.less_gloo_phase,
        at_peak_less_gloo=sorted(mem.at_peak_less_gloo.items(), key=lambda kv: -kv[1]),
        param_dtypes=v["param_dtypes"],
        **({"shard_dtypes": v["dtypes"]} if "dtypes" in v else {}),
    )


def _elements(cfg) -> int:
    from meshlm.models import Llama

    return sum(p.numel() for p in Llama(cfg, device="meta").parameters())


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _ratio(a, b) -> str:
    """a / b; where a is over b by less than the rounding shows, by how many bytes."""
    if not (a and b):
        return "-"
    r = f"{a / b:.2f}x"
    return f"{r} (+{a - b:,} B)" if a > b and r == "1.00x" else r


def _listing(live: list, k: int = 6) -> str:
    rest = sum(n for _op, n in live[k:])
    return ", ".join(f"{op} {_mb(n)}" for op, n in live[:k]) + (f", {len(live) - k} other {_mb(rest)}" if rest else "")


def render(results: dict, meta: dict) -> str:
    n = meta["parameters"]
    lines = [
        f"# bf16 training memory per rank: meshlm vs torch vs torchtitan ({meta['date']})",
        "",
        f"`{meta['command']}`: {meta['model']} ({n:,} parameters), global batch {meta['batch']} x seq "
        f"{meta['seq']}, 4 gloo ranks, AdamW, one measured step after one warm-up; {meta['machine']}, "
        f"torch {meta['torch']}; torchtitan {meta['torchtitan']}; {meta['wall_s']} s.",
        "",
        "Model state (MiB per rank, the larger of after-backward and after-step, largest rank; "
        "params / grads / master / adam = AdamW's state) and peak live tensor storage over the "
        "step (MiB, largest rank, activations included; in: the phase of the step where it fell). "
        "B/P = model-state bytes per parameter; m/t = meshlm / torch; m/titan = meshlm / torchtitan "
        "(`-`: torchtitan has no such layout, or is not installed). less gloo RS = the peak less "
        "gloo's reduce-scatter buffer (a whole-input-sized copy that c10d's gloo reduce-scatter, "
        "FSDP2's, keeps live and NCCL does not make; meshlm's is inside its collective op, never "
        "counted), and its ratios.",
        "",
        "| layout | mesh | impl | params | grads | master | adam | state | B/P | state m/t | state m/titan "
        "| peak | in | peak m/t | peak m/titan | less gloo RS | m/t | m/titan |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for lay, r in results.items():
        if "error" in r:
            lines.append(f"| {lay} | {r['mesh']} | error | {r['error']} |||||||||||||||")
            continue
        m, t, ti = r["meshlm"], r["torch"], r.get("titan")
        ok = ti is not None and "error" not in ti
        for impl in BUILDERS:
            x = r.get(impl)
            first = impl == "meshlm"
            head = f"| {lay if first else ''} | {r['mesh'] if first else ''} | {impl} | "
            if x is None:
                continue
            if "error" in x:
                lines.append(head + f"error: {x['error']} |||||||||||||||")
                continue
            s = x["state"]
            less = "peak_less_gloo"
            ratios = (
                (
                    _ratio(m["state"]["total"], t["state"]["total"]),
                    _ratio(m["state"]["total"], ti["state"]["total"]) if ok else "-",
                    _ratio(m["peak_bytes"], t["peak_bytes"]),
                    _ratio(m["peak_bytes"], ti["peak_bytes"]) if ok else "-",
                    _ratio(m[less], t[less]),
                    _ratio(m[less], ti[less]) if ok else "-",
                )
                if first
                else ("",) * 6
            )
            lines.append(
                head
                + " | ".join(_mb(s[k]) for k in KINDS)
                + f" | {_mb(s['total'])} | {s['total'] / n:.2f} | {ratios[0]} | {ratios[1]} | "
                + f"{_mb(x['peak_bytes'])} | {x['peak_phase']} | {ratios[2]} | {ratios[3]} | "
                + f"{_mb(x[less])} | {ratios[4]} | {ratios[5]} |"
            )
    lines += ["", "torch variants: " + "; ".join(f"{k}: {v}" for k, v in TORCH.items() if k in results) + "."]
    if any("titan" in r for r in results.values()):
        lines += [
            "torchtitan variants (its Llama 3 + `parallelize_llama`, `TrainingConfig(mixed_precision_param="
            '"bfloat16", mixed_precision_reduce="float32")`, i.e. FSDP2 `MixedPrecisionPolicy(bf16, fp32)` '
            "on every layout; meshlm's seed-0 weights loaded): "
            + "; ".join(f"{k}: {v}" for k, v in TITAN_TEXT.items() if "titan" in results.get(k, {}))
            + "; zero1: none."
        ]
    lines += [
        "meshlm dtypes (`meshlm.app.train.shard_dtypes`): "
        + "; ".join(
            f"{k}: params {r['meshlm']['param_dtypes']}, {r['meshlm']['shard_dtypes']}"
            for k, r in results.items()
            if "meshlm" in r
        )
        + "."
    ]

    def losses(r):
        return " ".join(f"{impl} {r[impl]['loss0']:.4f}" for impl in BUILDERS if "loss0" in r.get(impl, {}))

    lines += [
        "",
        "Warm-up losses (same seed-0 weights; meshlm's is the global batch's mean, torch's and "
        "torchtitan's rank 0's local batch's): "
        + "; ".join(f"{k} {losses(r)}" for k, r in results.items() if "meshlm" in r)
        + ".",
    ]
    lines += [
        "",
        "Live at the peak (largest rank), MiB by the op that made each storage and its dtype, the six "
        "largest, then the rest (`state at the start`: parameters, masters, AdamW state, DDP's buckets; "
        "the JSON lists them all):",
        "",
    ]
    for k, r in results.items():
        for impl in BUILDERS:
            x = r.get(impl, {})
            if "at_peak" in x:
                lines.append(f"- {k} {impl}: " + _listing(x["at_peak"]))
            if x.get("gloo_rs_at_peak") or x.get("peak_less_gloo", x.get("peak_bytes")) != x.get("peak_bytes"):
                lines.append(
                    f"- {k} {impl}, less gloo RS ({_mb(x['peak_less_gloo'])} MiB, in "
                    f"{x['less_gloo_phase']}): " + _listing(x["at_peak_less_gloo"])
                )
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
    from harness.dist import DistPool
    from meshlm.models import llama_config

    why = titan_llama.available()
    if why:
        print(f"NOTE: torchtitan column skipped ({why}); install it with `pip install -e .[bench]`")
        notes = [f"torchtitan: not a column (not installed: {why})"]
        titan_version = "not installed"
    else:
        from importlib.metadata import version

        titan_version = version("torchtitan")
        notes = (
            [
                f"torchtitan {titan_version}: no column for {', '.join(k for k in layouts if k not in TITAN)} "
                "(no such layout in torchtitan)"
            ]
            if any(k not in TITAN for k in layouts)
            else []
        )
    opts = dict(vars(args), titan=not why)
    results: dict = {}
    t_start = time.time()
    with DistPool(4, timeout_s=300, job_timeout_s=1800) as pool:
        for lay in layouts:
            t0 = time.time()
            try:
                per_rank = pool.run(_bench_layout, lay, LAYOUTS[lay], opts)
                r = dict(per_rank[0])
                for impl in BUILDERS:  # the largest rank
                    if "peak_bytes" not in r.get(impl, {}):
                        continue
                    top = max(per_rank, key=lambda p: p[impl]["peak_bytes"])
                    r[impl]["peak_by_rank"] = [p[impl]["peak_bytes"] for p in per_rank]
                    for k in ("peak_bytes", "peak_phase", "at_peak", "gloo_rs_at_peak"):
                        r[impl][k] = top[impl][k]
                    low = max(per_rank, key=lambda p: p[impl]["peak_less_gloo"])
                    for k in ("peak_less_gloo", "less_gloo_phase", "at_peak_less_gloo"):
                        r[impl][k] = low[impl][k]
                    r[impl]["state"] = max((p[impl]["state"] for p in per_rank), key=lambda k: k["total"])
            except Exception as e:  # noqa: BLE001 - one failed layout must not sink the table
                tb = getattr(e, "remote_traceback", "") or ""
                r = {
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    + (f" ({tb.strip().splitlines()[-1][:300]})" if tb.strip() else "")
                }
            r["mesh"] = LAYOUTS[lay]
            results[lay] = r
            if "error" in r:
                print(f"[{lay}] {time.time() - t0:.0f}s error {r['error']}", flush=True)
            else:
                print(
                    f"[{lay} {LAYOUTS[lay]}] {time.time() - t0:.0f}s "
                    + "; ".join(
                        f"{impl} state {r[impl].get('state')} peak {r[impl].get('peak_bytes')}"
                        + (f" error {r[impl]['error']}" if "error" in r[impl] else "")
                        for impl in BUILDERS
                        if impl in r
                    ),
                    flush=True,
                )
    cfg = llama_config(args.model)
    meta = dict(
        date=datetime.date.today().isoformat(),
        command=("python benchmarks/memory_floor.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}",
        torch=torch.__version__,
        torchtitan=titan_version,
        model=args.model,
        parameters=_elements(cfg),
        batch=args.batch,
        seq=args.seq,
        wall_s=round(time.time() - t_start),
        notes=notes,
    )
    write_report(
        Path(args.out), "memory_floor", {"meta": meta, "results": results}, render(results, meta), meta["wall_s"]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
