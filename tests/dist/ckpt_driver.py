"""A small multi-process training job for the crash tests (llama_tiny, ShardedOptimizer,
ShardedLoader, a warmup+cosine LR schedule, meshlm.train.checkpoint.Checkpointer).

    python tests/dist/ckpt_driver.py --nproc 2 --layout fsdp --mesh fsdp=2 --steps 8 \
        --dir CKPT --every 2 --log LOSSES [--resume auto] [--die-in-save STEP]

Rank 0 appends ``step loss.hex()`` to ``--log`` after every step.  The parent spawns the
workers and, like torchrun, kills them all when one dies, so a SIGKILL of one rank (or of
the whole process group from outside) ends the job.  ``--die-in-save STEP`` makes rank 1
SIGKILL itself inside the save of STEP, after its shard files are written and before the
checkpoint is committed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def lr_at(step: int, base: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def worker(rank: int, world: int, store_file: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file store: no port is chosen by one process and bound by another (see main)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import meshlm
    from meshlm.train.checkpoint import CheckpointConfig, Checkpointer
    from meshlm.data.text import DataConfig, ShardedLoader, TokenDataset
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    if args.die_in_save is not None and rank == 1:
        import torch.distributed.checkpoint as dcp

        orig = dcp.save

        def dying_save(*a, **kw):
            out = orig(*a, **kw)
            if STATE["step"] == args.die_in_save:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        dcp.save = dying_save

    mesh = meshlm.make_mesh(args.mesh)
    cfg = llama_config("llama_tiny")
    model = meshlm.shard(Llama(cfg, device="meta"), args.layout, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    data = TokenDataset.from_config(DataConfig(), seq_len=16)
    loader = ShardedLoader(data.train, 16, 8, dp_rank=0, dp_size=1, seed=0)  # global batch; shard_batch splits
    ck = Checkpointer(CheckpointConfig(dir=args.dir, every=args.every, keep=args.keep, resume=args.resume),
                      model=model, optimizer=opt, mesh=mesh, run_meta={"layout": args.layout, "mesh": args.mesh})
    start = 0
    extra = ck.resume()
    if extra:
        start = int(extra["step"])
        loader.load_state_dict(extra["loader"])
        assert extra["scheduler"]["step"] == start
    for step in range(start, args.steps):
        STATE["step"] = step + 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.lr, 2, args.steps)
        x, y = loader.next()
        loss = model(meshlm.shard_batch(x, args.layout, mesh), meshlm.shard_batch(y, args.layout, mesh))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(args.log, "a") as f:
                f.write(f"{step + 1} {float(loss).hex()}\n")
        if args.sleep:
            time.sleep(args.sleep)
        ck.maybe_save(step + 1, {"step": step + 1, "loader": loader.state_dict(), "scheduler": {"step": step + 1}})
    ck.close()
    dist.destroy_process_group()


STATE = {"step": 0}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layout", default="fsdp")
    p.add_argument("--mesh", default="fsdp=2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dir", required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--log", required=True)
    p.add_argument("--die-in-save", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    import multiprocessing as mp
    import tempfile

    # The process group meets in a file store of a fresh directory of this job's own, not on
    # a TCP port this parent picks and closes for rank 0 to bind later: nothing else can
    # take a file in the meantime, and a killed earlier job's leftovers are never reused.
    # It sits beside the log, in the test's own temporary directory, so that a job the test
    # kills (which never reaches the rmtree below) leaves nothing behind in /tmp.
    log_dir = os.path.dirname(os.path.abspath(args.log))
    store_dir = tempfile.mkdtemp(prefix="ckpt_driver_store_", dir=log_dir)
    ctx = mp.get_context("spawn")
    store = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=worker, args=(r, args.nproc, store, args)) for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    try:
        return _supervise(procs)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _supervise(procs: list) -> int:
    while True:  # like torchrun: one worker failing ends them all
        codes = [pr.exitcode for pr in procs]
        if any(c not in (None, 0) for c in codes):
            for pr in procs:
                if pr.exitcode is None:
                    pr.kill()
            for pr in procs:
                pr.join()
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)

if __name__ == "__main__":
    sys.exit(main())
