"""The training loop of ``meshlm train``: one process per mesh device.

``run(cfg, run_dir)`` is what each worker runs: it joins the process group (torchrun's or
the one ``meshlm.launch`` started), builds the mesh, lowers the ``model`` node's model built
on the meta device under the layout (NOTE [model node] in meshlm/model_config.py), and
trains it with a sharded AdamW (warmup + cosine LR, global-norm clipping, gradient
accumulation, mixed precision, activation checkpointing and torch.compile per block),
logging to the run directory from rank 0.

``python -m meshlm.train key=value ...`` under torchrun is ``meshlm train`` joining that
world (see docs/train.md for the multi-node command).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import meshlm.compile  # noqa: F401  (compile_blocks, referenced as meshlm.compile)
from meshlm import _torch_compat as compat
from meshlm import lifecycle
from meshlm.activation_checkpointing import apply_activation_checkpointing  # noqa: F401 (meshlm.train's API)
from meshlm.config import RunConfig, TrainConfig
from meshlm.errors import ConfigError, MeshError, MeshlmError
from meshlm.precision import LossScaler, shard_dtypes  # noqa: F401 (shard_dtypes: meshlm.train's API)
from meshlm.run_report import effective_layout, fmt_bytes, memory_line, planned_memory

log = logging.getLogger("meshlm.train")


class NonFiniteLossError(MeshlmError):
    """The loss became NaN or Inf."""


# --------------------------------------------------------------------------- helpers
def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``t.lr`` over ``t.warmup_steps`` steps, then cosine to ``t.min_lr``
    at ``t.steps``.  ``step`` counts from 1."""
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * frac))


def data_parallel_rank(layout, mesh, batch: int, seq: int) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: the mesh axes the
    layout splits the input batch over (ranks that differ only in tp/pp/ep share a rank)."""
    from meshlm.layout import INPUT_MESH_AXES, resolve
    from meshlm.mesh import mesh_spec

    sizes = mesh_spec(mesh).as_dict()
    plan = resolve(
        ("batch", "seq"),
        layout.compute,
        sizes,
        shape=(batch, seq),
        what=f"input batch ({batch} sequences of {seq} tokens per micro-batch)",
        layout=layout,
        allow_mesh=INPUT_MESH_AXES,
    )
    if plan[1]:
        raise ConfigError(
            f"layout {layout.name} shards the input sequence over {plan[1]} (context parallel); "
            "meshlm train does not feed sequence-sharded inputs yet: use a layout without seq: cp"
        )
    names = list(mesh.mesh_dim_names or ())
    rank, size = 0, 1
    for a in plan[0]:
        i = names.index(a)
        rank = rank * mesh.size(i) + mesh.get_local_rank(i)
        size *= mesh.size(i)
    return rank, size


def _device(t: TrainConfig) -> torch.device:
    if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _init_process_group(cfg: RunConfig, device: torch.device) -> None:
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.train.pg_timeout_s))


def check_world(cfg: RunConfig, world_size: int) -> None:
    """A mesh whose size differs from the number of processes: say both numbers."""
    need = cfg.mesh.size(world_size)
    if need != world_size:
        raise MeshError(
            f"mesh {cfg.mesh} has {need} devices but the job has {world_size} processes; make the mesh sizes "
            f"multiply to {world_size} (e.g. mesh.dp=-1 for 'the rest'), or launch {need} processes"
        )


def _setup_logging(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [h]
    log.setLevel(logging.INFO)
    log.propagate = False


# --------------------------------------------------------------------------- run
def run(cfg: RunConfig, run_dir: "str | os.PathLike") -> dict[str, Any]:
    """Train under ``cfg`` in this process (one rank of the job); return the run summary.

    Inside torchrun or ``meshlm.launch`` it joins that world; a one-device mesh also runs
    without any launcher."""
    import meshlm
    from meshlm.comm import CommCounter
    from meshlm.data import ShardedLoader, TokenDataset
    from meshlm.metrics import MetricsWriter, StepMemory, peak_memory_bytes, plot_loss
    from meshlm.model_build import build_sharded
    from meshlm.model_config import loss_of, model_vocab
    from meshlm.optim import ShardedOptimizer

    t = cfg.train
    clock = lifecycle.StartupClock()  # where start-up time goes: summary.json's startup_s
    run_dir = Path(run_dir)
    device = _device(t)
    _init_process_group(cfg, device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    check_world(cfg, world)
    torch.manual_seed(t.seed)
    mesh = meshlm.make_mesh(cfg.mesh.as_dict(), device_type=device.type)
    rank = dist.get_rank()
    is_main = rank == 0
    clock.mark("process_group")
    _setup_logging(run_dir, rank)
    if "OMP_NUM_THREADS" not in os.environ and device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))

    layout = meshlm.load_layout(cfg.layout.name)
    mcfg = lifecycle.model_config(cfg, cfg.model)  # resumed: the checkpoint's model and shapes
    from meshlm.mesh import mesh_spec

    eff = effective_layout(cfg, layout, mesh_spec(mesh).as_dict())  # layout.strict=true: a degenerate layout stops here

    shard_kw = dict(shard_dtypes(t, layout, mesh_spec(mesh).as_dict()), overlap=t.overlap)
    model = build_sharded(mcfg, layout, mesh, seed=t.seed, **shard_kw)
    n_ckpt = apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile != "none":
        meshlm.compile.compile_blocks(model, t.compile, comms=t.compile_comms)
    # fp32 storage is the master copy, or (ZeRO-1/2) the optimizer's sharded fp32 master
    # (NOTE [mixed precision] in meshlm/precision.py)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    scaler = LossScaler() if t.param_dtype == "float16" else None

    micro = t.batch_size // t.grad_accum
    dp_rank, dp_size = data_parallel_rank(layout, mesh, micro, t.seq_len)
    ds = TokenDataset.from_config(cfg.data, t.seq_len, init_from=cfg.model.init_from)
    ds.check_vocab(model_vocab(model), cfg.model.label)
    loader = ShardedLoader(ds.train, t.seq_len, micro, dp_rank, dp_size, seed=cfg.data.seed)

    def evaluate() -> float:
        vl = ShardedLoader(ds.val, t.seq_len, micro, dp_rank, dp_size, seed=cfg.data.seed)
        n = min(t.val_batches, vl.steps_per_epoch)
        total = 0.0
        model.eval()  # no dropout
        try:
            with torch.no_grad():
                for _ in range(n):
                    x, y = vl.next()
                    total += float(loss_of(model(x.to(device), y.to(device)), cfg.model))
        finally:
            model.train()
        return total / n

    # resume, save, stop on SIGTERM/SIGINT, and the lines that report them (meshlm/lifecycle.py)
    life = lifecycle.Lifecycle(
        cfg, model=model, optimizer=opt, mesh=mesh, layout_label=layout.name, mesh_label=str(cfg.mesh), device=device
    )
    start = life.resume(loader, scaler)
    clock.mark("build")

    n_params = sum(p.numel() for p in model.parameters())  # global sizes (DTensor numel)
    header = (
        f"meshlm train: {cfg.model.label} ({n_params / 1e6:.1f}M params), layout {eff.label()}, mesh {cfg.mesh} "
        f"({world} {dist.get_backend()} processes on {device.type}); {t.steps} steps of {t.batch_size}x{t.seq_len} "
        f"tokens; run dir {run_dir}"
    )
    log.info(header)
    log.info("config: %s", json.dumps(cfg.to_dict()))
    for w in eff.problems():
        log.warning(w)
    planned = planned_memory(cfg, layout.name, mesh_spec(mesh).as_dict())
    writer = None
    if is_main:
        print(header, flush=True)
        for w in eff.problems():
            print(f"meshlm train: warning: {w}", file=sys.stderr, flush=True)
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        if not (run_dir / "config.json").exists():
            (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if start >= t.steps:
        life.close()
        msg = lifecycle.nothing_to_do(start, t.steps, life)
        log.info(msg)
        if is_main:
            writer.close()
            print(f"meshlm train: {msg}", flush=True)
        return {"steps": t.steps, "start_step": start, "steps_run": 0, "global_step": start, "run_id": life.run_id}

    bar = None
    if is_main and t.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=t.steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
            life.say = bar.write
        except ImportError:
            bar = None

    prof = None
    comm_bytes: Optional[int] = None
    tokens_per_step = t.batch_size * t.seq_len
    rates: list[float] = []
    writer_rows = [0]
    first_loss = last_loss = val_loss = None
    skipped = 0
    measure_step = min(start + 2, t.steps)  # NOTE [run memory] in meshlm/metrics.py
    mem_kinds: dict[str, Any] = {}
    t_start = time.perf_counter()
    if t.memory_snapshot and device.type == "cuda":
        compat.record_cuda_memory_history(True, max_entries=100_000)
    model.train()
    life.install_signal_handlers()
    step = start
    for step in range(start + 1, t.steps + 1):
        if t.profile and step == t.profile_start:
            prof = torch.profiler.profile(record_shapes=True, profile_memory=True, with_stack=False)
            prof.__enter__()
        count = t.count_comm and t.compile == "none" and comm_bytes is None and step == measure_step
        counter = CommCounter(mesh) if count else None
        memory = StepMemory(model, opt, device, track_peak=t.compile == "none") if step == measure_step else None
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        for g in opt.param_groups:
            g["lr"] = lr
        if counter:
            counter.__enter__()
        if memory:
            memory.__enter__()
        try:
            loss_sum = 0.0
            for _ in range(t.grad_accum):
                x, y = loader.next()
                loss = loss_of(model(x.to(device), y.to(device)), cfg.model)
                if step == t.inject_nan_step:
                    loss = loss * float("nan")
                if t.inject_crash_step == step and rank == t.inject_crash_rank:
                    raise RuntimeError(f"injected crash on rank {rank} at step {step} (train.inject_crash_step)")
                micro_loss = loss / t.grad_accum
                (scaler.scale_loss(micro_loss) if scaler else micro_loss).backward()
                loss_sum += float(loss.detach())
            if memory:
                memory.after_backward()
            loss_val = loss_sum / t.grad_accum
            if not math.isfinite(loss_val):
                if not t.skip_nonfinite:
                    raise NonFiniteLossError(
                        f"loss is {loss_val} at step {step} (lr {lr:.3g}); lower train.lr, keep train.grad_clip > 0, "
                        "or set train.skip_nonfinite=true to skip such steps"
                    )
                opt.zero_grad()
                skipped += 1
                log.warning("step %d: loss %s, step skipped (train.skip_nonfinite)", step, loss_val)
                if writer:
                    writer.write({"step": step, "loss": None, "lr": lr, "skipped": True})
                continue
            if scaler is not None:  # unscale, one all-reduce for inf/nan, clip, step or skip
                loss_scale = scaler.scale
                gnorm, stepped = scaler.step(opt, t.grad_clip)
                opt.zero_grad()
                if not stepped:
                    skipped += 1
                    log.warning(
                        "step %d: float16 gradients overflowed at loss scale %g, step skipped; scale now %g",
                        step,
                        loss_scale,
                        scaler.scale,
                    )
                    if writer:
                        writer.write(
                            {"step": step, "loss": loss_val, "lr": lr, "skipped": True, "loss_scale": loss_scale}
                        )
                    continue
            else:
                gnorm = float(opt.clip_grad_norm_(t.grad_clip)) if t.grad_clip > 0 else None
                opt.step()
                opt.zero_grad()
        finally:
            if memory:
                memory.__exit__(None, None, None)
                mem_kinds = memory.result
            if counter:
                counter.__exit__(None, None, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if counter:
            comm_bytes = int(sum(c.wire_bytes for c in counter.records))
        if prof is not None and step == t.profile_start + t.profile_steps - 1:
            prof.__exit__(None, None, None)
            (run_dir / "profile").mkdir(exist_ok=True)
            prof.export_chrome_trace(str(run_dir / "profile" / f"trace_rank{rank}.json"))
            prof = None
        tps = tokens_per_step / dt
        if step > start + 1 and step != measure_step:
            rates.append(tps)  # the first step includes compilation and warm-up; the measured one, tracking
        if first_loss is None:
            clock.mark("first_step")
            first_loss = loss_val
        last_loss = loss_val
        mem = peak_memory_bytes(device)
        row: dict[str, Any] = {
            "step": step,
            "steps_run": step - start,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": gnorm,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "tokens": (step - start) * tokens_per_step,
            "wall_s": time.perf_counter() - t_start,
            "rss_bytes": mem,
        }
        if step == measure_step:
            row.update({f"mem_{k}_bytes": v for k, v in mem_kinds.items()})
        if not writer_rows[0]:
            row["layout_effective"] = eff.label()
        writer_rows[0] += 1
        if comm_bytes is not None:
            row["comm_bytes"] = comm_bytes
        if scaler is not None:
            row["loss_scale"] = scaler.scale
        if step == t.steps or (t.val_every and step % t.val_every == 0):
            val_loss = evaluate()
            row["val_loss"] = val_loss
            log.info("step %d val_loss %.4f", step, val_loss)
            if bar is not None:
                bar.write(f"step {step}: val_loss {val_loss:.4f}")
        if step % t.log_every == 0 or "val_loss" in row:
            log.info(
                "step %d loss %.4f lr %.3g grad_norm %s tok/s %.0f mem %s",
                step,
                loss_val,
                lr,
                gnorm,
                tps,
                fmt_bytes(mem),
            )
            if writer:
                writer.write(row)
        if bar is not None:
            bar.set_postfix_str(f"loss {loss_val:.3f} tok/s {tps:,.0f} mem {fmt_bytes(mem)}", refresh=False)
            bar.update(1)
        if life.after_step(step, functools.partial(_ckpt_state, step, loader, scaler)):
            break  # SIGTERM/SIGINT: saved (NOTE [stopping on a signal] in meshlm/lifecycle.py)
    if bar is not None:
        bar.close()
    life.close()
    if t.memory_snapshot and device.type == "cuda":
        compat.dump_cuda_memory_snapshot(str(run_dir / f"memory_snapshot_rank{rank}.pickle"))
        compat.record_cuda_memory_history(False)
    wall = time.perf_counter() - t_start

    # Memory of the fullest rank, by kind (NOTE [run memory]; -1: not measured), and the
    # process's resident set (CPU) or allocator peak (CUDA) over the run.
    kinds = ("params", "grads", "optimizer", "peak")
    vals = [mem_kinds.get(k) for k in kinds] + [peak_memory_bytes(device)]
    peak = torch.tensor([-1 if v is None else v for v in vals], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    measured = {f"mem_{k}_bytes": (int(v) if v >= 0 else None) for k, v in zip(kinds, peak.tolist()[:4])}
    rates.sort()
    summary = {
        "layout": layout.name,
        "mesh": str(cfg.mesh),
        "model": cfg.model.label,
        "world_size": world,
        "steps": t.steps,
        "start_step": start,
        "steps_run": step - start,
        "global_step": step,
        "run_id": life.run_id,
        "stopped_by": life.stop_name,
        "skipped_steps": skipped,
        "tokens_per_s": rates[len(rates) // 2] if rates else None,  # median: robust to noisy neighbours
        "layout_effective": eff.label(),
        "layout_warnings": eff.problems(),
        "grad_accum": t.grad_accum,
        "tokens_per_step": tokens_per_step,
        **measured,
        **{f"planned_{k}_bytes": v for k, v in (planned or {}).items()},
        "rss_bytes_per_rank": int(peak[4].item()),
        "comm_bytes_per_step": comm_bytes,
        "first_train_loss": first_loss,
        "final_train_loss": last_loss,
        "final_val_loss": val_loss,
        "wall_s": wall,
        "startup_s": clock.result(),
        "activation_checkpointed_blocks": n_ckpt,
    }
    if is_main:
        assert writer is not None
        writer.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        from meshlm.metrics import read_metrics

        plot_loss(
            read_metrics(run_dir / "metrics.jsonl"),
            run_dir / "loss.png",
            title=f"{cfg.model.label} {layout.name} mesh {cfg.mesh}",
        )
        tp = summary["tokens_per_s"]  # None: no step was timed (the first and the memory-measuring one are not)
        rate = f"{tp:,.0f} tokens/s" if tp else "tokens/s not timed (too few steps)"
        if life.stop_signal:
            print(f"meshlm train: {life.stopped_line(step)}", flush=True)
        else:
            print(
                f"done: {life.steps_line(step, t.steps)} in {wall:.0f}s; loss {first_loss:.3f} -> {last_loss:.3f}, "
                f"val_loss {val_loss:.3f}; {rate}; memory/rank {memory_line(summary)}; outputs in "
                f"{run_dir}",
                flush=True,
            )
    log.info("summary: %s", json.dumps(summary))
    return summary


def _ckpt_state(step: int, loader, scaler) -> dict[str, Any]:
    """What a checkpoint holds besides the tensors: step, data-loader position, loss scale."""
    state = {"step": step, "loader": loader.state_dict()}
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    return state


# --------------------------------------------------------------------------- worker entry
def worker(cfg: RunConfig, run_dir: str, launch_t0: Optional[float] = None) -> None:
    """Entry point of a worker started by ``meshlm.launch``: train, then leave the process
    group.  On an error the worker records it in the launcher's error file (the root cause
    the launcher prints once) and in ``logs/rank<N>.log``, and exits quietly with status 1."""
    if launch_t0 is not None:  # a forkserver's environment is that of the job it first served
        os.environ[lifecycle.LAUNCH_T0] = str(launch_t0)
    try:
        run(cfg, run_dir)
    except BaseException as e:  # noqa: BLE001 - everything must reach the error file
        tb = traceback.format_exc()
        try:
            log.error("failed:\n%s", tb)
        except Exception:  # noqa: BLE001
            pass
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
        sys.stdout.flush()
        os._exit(1)  # skip atexit/PG teardown, which could wait on ranks that are gone
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    # ``python -m meshlm.train [overrides]``: the same as ``meshlm train [overrides]``.  Only
    # here, never at import: train.py is below the CLI (tests/unit/test_imports.py).
    from meshlm.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
