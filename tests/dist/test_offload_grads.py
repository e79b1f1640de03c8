"""Offloaded gradients (NOTE [offloaded gradients] in meshlm/runtime/offload/grads.py): the same layout
with and without ``offload.grads=disk`` gives the same losses, reduced gradients, gradient
norms, weights and AdamW state after three steps of two micro-batches each, with a loss
scale unscaled and the norm clipped (so every path that reads or writes gradients between
backward and the step runs), bit for bit, on 1, 2 and 4 gloo processes.  At the end of each
backward no gradient is in memory: ``.grad`` is None and every accumulated gradient holds 0
bytes, its bytes in a file; after ``zero_grad`` the files are gone.  A step moves each
gradient out once per micro-batch and in once per later micro-batch, for the norm and for
the step: unscaling and clipping defer their factors rather than rewrite the files."""

from __future__ import annotations

import os

import pytest
import torch

from harness import dist_pool_fixture

pool1 = dist_pool_fixture(1, timeout_s=90)
pool2 = dist_pool_fixture(2, timeout_s=90)
pool4 = dist_pool_fixture(4, timeout_s=90)

STEPS, ACCUM = 3, 2


def _batches(vocab: int):
    from harness.setup import accumulation_batches

    return accumulation_batches(vocab, STEPS, ACCUM, seed=5)


def _job(
    layout: str, shape: str, grads: str | None, optimizer: str | None, base: str, compiled: bool = False, dtype=None
):
    import meshlm
    from meshlm.runtime.memory import local_data
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.store import SwapDir, Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.layout.precision import LossScaler
    from harness.recipes import full_many

    torch._dynamo.reset()
    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(shape)
    kw = {}
    if dtype is not None:  # bf16 storage: ZeRO-1/2 accumulate float32 main gradients (NOTE [main grads])
        from meshlm.app.config import TrainConfig
        from meshlm.layout.precision import shard_dtypes

        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        kw = shard_dtypes(TrainConfig(param_dtype=dtype), meshlm.load_layout(layout), sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0, **kw)
    if compiled:
        import meshlm.runtime.compile

        meshlm.runtime.compile.compile_blocks(model, "aot_eager")
    rank = torch.distributed.get_rank()
    disk = SwapDir(base, rank, run_id="g") if "disk" in (grads, optimizer) else None
    gswap = Swapper(grads, disk) if grads else None
    oswap = Swapper(optimizer, disk) if optimizer else None
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload=oswap, offload_grads=gswap)
    scaler = LossScaler(init_scale=2.0**6)
    rec = {"loss": [], "grad": [], "norm": [], "state": [], "after_backward": [], "files": [], "traffic": []}
    for micro in _batches(cfg.vocab):
        moved = (gswap.bytes_in, gswap.bytes_out) if gswap is not None else (0, 0)
        for x, y in micro:
            loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh)) / ACCUM
            scaler.scale_loss(loss).backward()
            rec["loss"].append(float(loss))
        rec.setdefault("main_grads", []).append(sum(getattr(p, "main_grad", None) is not None for p in model.parameters()))
        if gswap is not None:  # nothing of the gradients in memory between backward and the step
            go = opt.grad_offload
            rec["after_backward"].append(
                (
                    [p.grad is None for p in model.parameters()],
                    [gswap.is_out(t) for t in go.held],
                    [t.untyped_storage().nbytes() for t in go.held],
                    len(go.held),
                )
            )
        norm, stepped = scaler.step(opt, max_norm=0.5)  # unscale, norm, clip (0.5: it clips), step
        assert stepped
        rec["norm"].append(norm)
        if gswap is not None:  # (bytes read, bytes written, bytes of the gradients held) this step
            held = sum(t.numel() * t.element_size() for t in opt.grad_offload.held)
            rec["traffic"].append((gswap.bytes_in - moved[0], gswap.bytes_out - moved[1], held))
        with opt.resident():
            rec["grad"].append({k: g.clone() for k, g in full_many({k: m.grad for k, m in opt.masters().items()}).items()})
        opt.zero_grad()
        if disk is not None:
            rec["files"].append(len([f for f in os.listdir(disk.path) if f.endswith(".bin")]))
        with opt.resident():
            sd = {f"param/{k}": v.detach().clone() for k, v in full_many(dict(model.named_parameters())).items()}
            for fqn, m in opt.masters().items():
                for k, v in full_many(dict(opt.inner.state.get(m, {}))).items():
                    sd[f"state/{fqn}/{k}"] = v.clone()
        rec["state"].append(sd)
    rec["peak_resident"] = opt.grad_offload.peak_resident if gswap is not None else 0
    rec["largest"] = max(local_data(p).numel() * 4 for p in model.parameters())
    if disk is not None:
        disk.close()
    return rec


def _same(a: dict, b: dict, what: str) -> None:
    assert a["loss"] == b["loss"], what
    assert a["norm"] == b["norm"], f"{what}: gradient norms differ"
    for k in range(STEPS):
        for kind in ("grad", "state"):
            assert sorted(a[kind][k]) == sorted(b[kind][k]), (what, kind)
            for n, v in a[kind][k].items():
                assert torch.equal(v, b[kind][k][n]), f"{what}: step {k + 1} {kind} {n} differs"


CASES = [
    (1, "single", "dp=1", None, False, None),
    (2, "fsdp", "fsdp=2", None, False, None),
    (2, "ddp", "dp=2", "disk", True, None),  # with the optimizer on disk too, blocks compiled
    (2, "zero1", "dp=2", None, False, None),  # gradients reduce-scattered into the masters' at the step
    (2, "zero2", "dp=2", None, False, None),
    # bf16 storage: float32 main gradients, accumulated outside .grad (NOTE [main grads])
    (2, "zero1", "dp=2", "disk", False, "bfloat16"),
    (2, "zero2", "dp=2", None, False, "bfloat16"),
    (4, "fsdp_tp", "fsdp=2,tp=2", None, False, None),
]


@pytest.mark.parametrize("world,layout,shape,optimizer,compiled,dtype", CASES)
def test_disk_grads_equal_no_offload(world, layout, shape, optimizer, compiled, dtype, tmp_path, pool1, pool2, pool4):
    pool = {1: pool1, 2: pool2, 4: pool4}[world]
    base = pool.run(_job, layout, shape, None, None, str(tmp_path), compiled, dtype)
    off = pool.run(_job, layout, shape, "disk", optimizer, str(tmp_path), compiled, dtype)
    for r in range(world):
        # bf16: the run without offload holds main gradients after backward; offloaded, they are on the tier
        assert off[r]["main_grads"] == [0] * STEPS and (min(base[r]["main_grads"]) > 0) == (dtype is not None)
        _same(off[r], base[r], f"{layout} {shape} rank {r}")
        for none, out, nbytes, n in off[r]["after_backward"]:
            assert all(none), "a parameter kept its .grad after backward"
            assert n > 0 and all(out) and set(nbytes) == {0}, "a gradient stayed in memory after backward"
        # while taking one gradient, at most it and the accumulated one are in memory
        assert 0 < off[r]["peak_resident"] <= 2 * off[r]["largest"]
        if optimizer is None:
            assert off[r]["files"] == [0] * STEPS  # zero_grad removed every gradient's file
        if layout != "zero1":  # (zero1 also writes and reads its reduce-scattered shards)
            # written once per micro-batch, read back by the second, by the norm and by the step;
            # unscaling and clipping rewrite nothing (NOTE [offloaded gradients])
            assert all(i == 3 * g and o == 2 * g > 0 for i, o, g in off[r]["traffic"]), off[r]["traffic"]


def test_host_grads_on_cpu_equal(tmp_path, pool2):
    base = pool2.run(_job, "fsdp", "fsdp=2", None, None, str(tmp_path))
    host = pool2.run(_job, "fsdp", "fsdp=2", "host", None, str(tmp_path))
    for r in range(2):
        _same(host[r], base[r], f"host rank {r}")


def _scaled(grads: str | None, base: str):
    """Gradients scaled inside ``opt.resident()`` (in memory: multiplied and written back)
    and outside it (on the tier: the factor deferred), then read."""
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.store import SwapDir, Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from harness.recipes import full_many

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh("fsdp=2")
    model = meshlm.shard(Llama(cfg, device="meta"), "fsdp", mesh, seed=0)
    swap = Swapper(grads, SwapDir(base, torch.distributed.get_rank(), run_id="s")) if grads else None
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=1.0, offload_grads=swap)
    (x, y), _ = _batches(cfg.vocab)[0]
    model(meshlm.shard_batch(x, "fsdp", mesh), meshlm.shard_batch(y, "fsdp", mesh)).backward()
    opt.reduce_grads()
    opt.scale_grads(0.75)  # deferred
    with opt.resident():
        opt.scale_grads(0.5)  # in memory: applied and written back with the deferred one
    opt.scale_grads(0.25)  # deferred again
    opt.step()
    with opt.resident():
        out = {k: g.clone() for k, g in full_many({k: m.grad for k, m in opt.masters().items()}).items()}
    out |= {f"param/{k}": v.detach().clone() for k, v in full_many(dict(model.named_parameters())).items()}
    if swap is not None:
        swap.disk.close()
    return out


def test_scaling_inside_and_outside_resident_is_applied_once(tmp_path, pool2):
    base = pool2.run(_scaled, None, str(tmp_path))
    off = pool2.run(_scaled, "disk", str(tmp_path))
    for r in range(2):
        assert sorted(off[r]) == sorted(base[r])
        for k, v in base[r].items():
            assert torch.equal(off[r][k], v), f"rank {r}: {k} differs"
