"""The training loop of ``meshlm train``: one process per mesh device.

``run(cfg, run_dir)`` is what each worker runs: it joins the process group (torchrun's or
the one ``meshlm.app.launch`` started), builds the mesh, lowers the ``model`` node's model built
on the meta device under the layout (NOTE [model node] in meshlm/models/node.py), and
trains it with any optimizer (``optim``, sharded; warmup and a schedule: meshlm/train/schedule.py;
global-norm clipping, gradient accumulation, mixed precision, activation checkpointing and
torch.compile per block),
logging to the run directory from rank 0.

``python -m meshlm.app.train key=value ...`` under torchrun is ``meshlm train`` joining that
world (see docs/train.md for the multi-node command).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import meshlm.runtime.compile  # noqa: F401  (compile_blocks, referenced as meshlm.runtime.compile)
from meshlm import _torch_compat as compat
from meshlm.app import train_setup as setup
from meshlm.app.config import RunConfig, check_batch, offload_spec
from meshlm.app.optimizer import impl_kwargs, make_optimizer
from meshlm.app.run_report import done_line, effective_layout, fmt_bytes, gather_memory, planned_memory, run_summary
from meshlm.app.tracking import Tracker, chosen
from meshlm.app.train_setup import check_world, data_parallel_rank  # noqa: F401 (meshlm.app.train's API)
from meshlm.layout.mesh import MeshSpec
from meshlm.layout.precision import LossScaler, shard_dtypes  # noqa: F401 (shard_dtypes: meshlm.app.train's API)
from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing  # noqa: F401 (meshlm.app.train's API)
from meshlm.runtime.offload.runtime import open_offload
from meshlm.runtime.pipeline import is_pipelined
from meshlm.train import lifecycle
from meshlm.train.checkpoint import lock as _ckpt_lock
from meshlm.train.step import NonFiniteLossError, accumulate, evaluate, lr_at, train_step  # noqa: F401 (meshlm.app.train's API)

log = logging.getLogger("meshlm.app.train")


# --------------------------------------------------------------------------- run
def run(cfg: RunConfig, run_dir: "str | os.PathLike") -> dict[str, Any]:
    """Train under ``cfg`` in this process (one rank of the job); return the run summary.

    Inside torchrun or ``meshlm.app.launch`` it joins that world; a one-device mesh also runs
    without any launcher."""
    from meshlm.app.model_build import build_pipelined, build_sharded, model_vocab
    from meshlm.data.images import open_dataset
    from meshlm.layout.mesh import make_mesh
    from meshlm.layout.rules import load_layout
    from meshlm.runtime.comm import CommCounter
    from meshlm.train.metrics import MetricsWriter, StepMemory, peak_memory_bytes, plot_loss, read_metrics

    t = cfg.train
    clock = lifecycle.StartupClock()  # where start-up time goes: summary.json's startup_s
    run_dir = Path(run_dir)
    device = setup.device_for(t)
    setup.init_process_group(cfg, device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    check_world(cfg, world)
    torch.manual_seed(t.seed)
    layout = load_layout(cfg.layout.name)
    pipelined = is_pipelined(layout) and cfg.mesh.pp > 1  # NOTE [pipelined step] in meshlm/runtime/pipeline/pipe.py
    mesh = None if pipelined else make_mesh(cfg.mesh.as_dict(), device_type=device.type)
    rank = dist.get_rank()
    is_main = rank == 0
    clock.mark("process_group")
    setup.logging_to(run_dir, rank)
    # one run writes a checkpoint directory: a second one stops here, before building anything
    ckpt_lock = lifecycle.lock_checkpoint_dir(cfg, run_dir)
    # offload tiers (NOTE [offload tiers] in meshlm/runtime/offload/__init__.py), checked before any step; made before
    # the model, since a disk tier sets how freed memory goes back to the system (offload.runtime.return_freed_memory)
    offload = open_offload(offload_spec(cfg, layout), layout, cfg.mesh.pp, run_dir, rank)
    if "OMP_NUM_THREADS" not in os.environ and device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))

    mcfg = lifecycle.model_config(cfg, cfg.model)  # resumed: the checkpoint's model and shapes
    sizes = MeshSpec.parse(cfg.mesh.as_dict(), world).as_dict()
    check_batch(cfg, sizes)  # the config check skipped it while a mesh axis was -1 (the rest of the world)
    eff = effective_layout(cfg, layout, sizes)  # layout.strict=true: a degenerate layout stops here

    shard_kw = dict(shard_dtypes(t, layout, sizes), overlap=t.overlap)
    pipe = None
    if pipelined:
        pipe = build_pipelined(cfg, mcfg, layout, device.type, seed=t.seed, **shard_kw)
        model, mesh = pipe.model, pipe.mesh
    else:
        # offloaded parameters go to their tier block by block as they are made (NOTE [offloaded parameters])
        spill = offload.spill if offload is not None and offload.spills else None
        model = build_sharded(mcfg, layout, mesh, seed=t.seed, after_block=spill, **shard_kw)
    n_ckpt = apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile != "none":
        # a pipeline keeping its parameters gathered through the step compiles the blocks' math
        # only, its gathers eager (NOTE [gathered once per step] in meshlm/runtime/pipeline/pipe.py)
        comms = "eager" if pipe is not None and pipe.keep_gathered else t.compile_comms
        meshlm.runtime.compile.compile_blocks(model, t.compile, comms=comms)
    # fp32 storage is the master copy, or (ZeRO-1/2) the optimizer's sharded fp32 master
    # (NOTE [mixed precision] in meshlm/layout/precision.py)
    # any optimizer class (optim._target_), its no-decay groups (NOTE [optim node] in meshlm/app/optimizer.py)
    opt = make_optimizer(
        cfg,
        model,
        lr=lr_at(1, t),
        pipelined=pipelined,
        **impl_kwargs(cfg.optim, t, offload, device),
        offload=offload.optimizer if offload else None,
        offload_params=offload.attach(model) if offload else None,
        offload_grads=offload.grads if offload else None,
    )
    if pipe is not None:
        pipe.attach(opt)  # the other stages' gradients count in the norm; reductions start in backward
    scaler = LossScaler() if t.param_dtype == "float16" else None

    micro = t.batch_size // t.grad_accum
    dp_rank, dp_size = data_parallel_rank(layout, mesh, micro, t.seq_len)
    cfg = setup.with_resumed_tokenizer(cfg)  # NOTE [run tokenizer] in meshlm/train/checkpoint/assets.py
    ds = open_dataset(cfg.data, t.seq_len, cfg.model, run_dir)  # text, tokens or images (meshlm/data/images.py)
    ds.check_vocab(model_vocab(model), cfg.model.label)
    loader = setup.split_for_cp(
        ds.loader("train", t.seq_len, micro, dp_rank, dp_size, seed=cfg.data.seed), layout, mesh, cfg.data.format
    )

    # resume, save, stop on SIGTERM/SIGINT, and the lines that report them (meshlm/train/lifecycle.py)
    life = lifecycle.Lifecycle(
        cfg,
        model=model,
        optimizer=opt,
        mesh=mesh,
        layout_label=layout.name,
        mesh_label=str(cfg.mesh),
        device=device,
        lock=ckpt_lock,
        run_dir=str(run_dir),
    )
    start = life.resume(loader, scaler)
    resumed = (life.ckpt.resumed or {}).get("path") if life.ckpt is not None else None
    setup.record_assets(setup.run_assets(cfg, resumed), run_dir, life, is_main)
    clock.mark("build")

    # global sizes (DTensor numel); a pipeline stage holds part of the model: the probe counted all of it
    n_params = sum(pipe.probe.numel.values()) if pipe else sum(p.numel() for p in model.parameters())
    header = (
        f"meshlm train: {cfg.model.label} ({n_params / 1e6:.1f}M params), layout {eff.label()}, mesh {cfg.mesh} "
        f"({world} {dist.get_backend()} processes on {device.type}); {t.steps} steps of {t.batch_size}x{t.seq_len} "
        f"tokens; run dir {run_dir}"
    )
    log.info(header)
    log.info("config: %s", json.dumps(cfg.to_dict()))
    for w in eff.problems():
        log.warning(w)
    planned = None if pipelined else planned_memory(cfg, layout.source, sizes)  # a user layout: its path
    writer = None
    if is_main:
        print(header, flush=True)
        for w in eff.problems():
            print(f"meshlm train: warning: {w}", file=sys.stderr, flush=True)
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        if not (run_dir / "config.json").exists():
            (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tracking = bool(chosen(cfg.logger))  # the same on every rank: all take part in the memory gather
    tracker = Tracker(cfg, run_dir, life.run_id, eff.label()) if tracking and is_main else None
    if start >= t.steps:
        life.close()
        if offload is not None:
            offload.close()
        msg = lifecycle.nothing_to_do(start, t.steps, life)
        log.info(msg)
        if is_main:
            writer.close()
            if tracker is not None:
                tracker.close()
            print(f"meshlm train: {msg}", flush=True)
        return {"steps": t.steps, "start_step": start, "steps_run": 0, "global_step": start, "run_id": life.run_id}

    if offload is not None:
        log.info("offload: %s%s", offload.spec.label(), f" (swap files in {offload.disk.path})" if offload.disk else "")
    bar = setup.progress_bar(t, start, life) if is_main else None
    prof = None
    comm_bytes: Optional[int] = None
    tokens_per_step = t.batch_size * t.seq_len
    rates: list[float] = []
    rows_written = 0
    first_loss = last_loss = val_loss = None
    skipped = 0
    measure_step = min(start + 2, t.steps)  # NOTE [run memory] in meshlm/train/metrics.py
    mem_kinds: dict[str, Any] = {}
    if pipe is not None:
        passes = pipe.passes(loader.next, device, seed=t.seed)
    else:
        passes = accumulate(model, loader.next, t, cfg.model, device, rank, opt)
    if offload is not None:
        passes = offload.wrap(passes)
        offload.trim()  # what the optimizer and the blocks moved out, back to the system now
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
        with contextlib.ExitStack() as measuring:
            for m in (counter, memory):
                if m is not None:
                    measuring.enter_context(m)
            out = train_step(passes, opt, t, step, lr, scaler, memory.after_backward if memory else None)
        ranks_memory = None
        if memory:
            mem_kinds = memory.result
            if tracking:  # every rank's memory, for the trackers (NOTE [experiment tracking])
                ranks_memory = [None] * world if is_main else None
                dist.gather_object(mem_kinds, ranks_memory, dst=0)
        if out.skipped:
            skipped += 1
            if writer:
                loss = None if out.skipped == "nonfinite" else out.loss
                scale = {} if out.loss_scale is None else {"loss_scale": out.loss_scale}
                writer.write({"step": step, "loss": loss, "lr": lr, "skipped": True, **scale})
            continue
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
            first_loss = out.loss
        last_loss = out.loss
        mem = peak_memory_bytes(device)
        row: dict[str, Any] = {
            "step": step,
            "steps_run": step - start,
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "tokens": (step - start) * tokens_per_step,
            "wall_s": time.perf_counter() - t_start,
            "rss_bytes": mem,
        }
        if step == measure_step:
            row.update({f"mem_{k}_bytes": v for k, v in mem_kinds.items()})
        if offload is not None:
            row.update(offload.stats(opt))
        if not rows_written:
            row["layout_effective"] = eff.label()
        rows_written += 1
        if comm_bytes is not None:
            row["comm_bytes"] = comm_bytes
        if scaler is not None:
            row["loss_scale"] = scaler.scale
        if step == t.steps or (t.val_every and step % t.val_every == 0):
            vl = setup.split_for_cp(
                ds.loader("val", t.seq_len, micro, dp_rank, dp_size, seed=cfg.data.seed), layout, mesh, cfg.data.format
            )
            val_loss = evaluate(pipe or model, vl, t.val_batches, cfg.model, device)
            row["val_loss"] = val_loss
            log.info("step %d val_loss %.4f", step, val_loss)
            if bar is not None:
                bar.write(f"step {step}: val_loss {val_loss:.4f}")
        logged = step % t.log_every == 0 or "val_loss" in row
        if logged:
            log.info(
                "step %d loss %.4f lr %.3g grad_norm %s tok/s %.0f mem %s",
                *(step, out.loss, lr, out.grad_norm, tps, fmt_bytes(mem)),
            )
            if writer:
                writer.write(row)
        if tracker is not None and (logged or ranks_memory):
            tracker.log(row, ranks_memory)
        if bar is not None:
            bar.set_postfix_str(f"loss {out.loss:.3f} tok/s {tps:,.0f} mem {fmt_bytes(mem)}", refresh=False)
            bar.update(1)
        if life.after_step(step, functools.partial(setup.ckpt_state, step, loader, scaler)):
            break  # SIGTERM/SIGINT: saved (NOTE [stopping on a signal] in meshlm/train/lifecycle.py)
    if bar is not None:
        bar.close()
    life.close(handlers=False)  # SIGTERM/SIGINT still only set the flag until the end
    if offload is not None:
        offload.close()
    if t.memory_snapshot and device.type == "cuda":
        compat.dump_cuda_memory_snapshot(str(run_dir / f"memory_snapshot_rank{rank}.pickle"))
        compat.record_cuda_memory_history(False)
    wall = time.perf_counter() - t_start

    summary = run_summary(
        cfg,
        layout_name=layout.name,
        world=world,
        start=start,
        step=step,
        life=life,
        eff=eff,
        skipped=skipped,
        rates=rates,
        memory=gather_memory(mem_kinds, device, world),
        planned=planned,
        comm_bytes=comm_bytes,
        losses=(first_loss, last_loss, val_loss),
        wall=wall,
        startup=clock.result(),
        checkpointed=n_ckpt,
        build=getattr(model, "_meshlm_build", None) or ({"how": "meta", "bytes": None} if pipe else None),
    )
    if is_main:
        assert writer is not None
        writer.close()
        if tracker is not None:
            tracker.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_loss(
            read_metrics(run_dir / "metrics.jsonl"),
            run_dir / "loss.png",
            title=f"{cfg.model.label} {layout.name} mesh {cfg.mesh}",
        )
        if life.stop_signal:
            print(f"meshlm train: {life.stopped_line(step)}", flush=True)
        else:
            print(done_line(summary, life.steps_line(step, t.steps), run_dir), flush=True)
    log.info("summary: %s", json.dumps(summary))
    # only now: a signal during the summary and loss plot (the launcher's agent sends one again when
    # a second signal interrupts its shutdown) must not kill the process before its line is out
    life.restore_signal_handlers()
    return summary


# --------------------------------------------------------------------------- worker entry
def worker(cfg: RunConfig, run_dir: str, launch_t0: Optional[float] = None) -> None:
    """Entry point of a worker started by ``meshlm.app.launch``: train, then leave the process
    group.  On an error the worker records it in the launcher's error file (the root cause
    the launcher prints once) and in ``logs/rank<N>.log``, and exits quietly with status 1."""
    if launch_t0 is not None:  # a forkserver's environment is that of the job it first served
        os.environ[lifecycle.LAUNCH_T0] = str(launch_t0)
    summary: dict = {}
    try:
        summary = run(cfg, run_dir) or {}
    except BaseException as e:  # noqa: BLE001 - everything must reach the error file
        tb = traceback.format_exc()
        try:
            log.error("failed:\n%s", tb)
        except Exception:  # noqa: BLE001
            pass
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
        sys.stdout.flush()
        _ckpt_lock.release_all()  # os._exit would leave LOCK naming this process
        if "meshlm.runtime.offload.store" in sys.modules:  # os._exit skips atexit: remove this rank's swap files
            sys.modules["meshlm.runtime.offload.store"].close_all()
        os._exit(1)  # skip atexit/PG teardown, which could wait on ranks that are gone
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary.get("stopped_by"):
        # Stopped on a signal, saved (NOTE [stopping on a signal] in lifecycle.py).  The agent
        # that passed the signal on is shutting down and reads no return value: returning
        # would leave this process waiting for it until the agent's 30 s grace period ends in
        # SIGKILL, past a scheduler's own grace period (Kubernetes: 30 s).  Leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        if "meshlm.runtime.offload.store" in sys.modules:
            sys.modules["meshlm.runtime.offload.store"].close_all()
        os._exit(0)


if __name__ == "__main__":
    # ``python -m meshlm.app.train [overrides]``: the same as ``meshlm train [overrides]``.  Only
    # here, never at import: train.py is below the CLI (tests/unit/test_imports.py).
    from meshlm.app.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
