"""Offloaded optimizer state (NOTE [offloaded step] in meshlm/runtime/offload/optimizer.py): the same
layout with and without ``offload.optimizer=disk|host`` gives the same losses, gradients,
weights and AdamW state after three steps with gradient accumulation, bit for bit (the
offloaded step does the same arithmetic chunk by chunk; only storage moves), on 1, 2 and 4
gloo processes; between steps the offloaded tensors hold no memory and their bytes are in
files of this run's own directory, removed when the run closes.

The model is the shipped Llama with bf16 parameters over fp32 masters under ZeRO-1 as well
(the masters are then tensors of their own, and move too)."""

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

    return accumulation_batches(vocab, STEPS, ACCUM, seed=3)


def _state(model, opt) -> dict:
    from meshlm.runtime.lowering import full_state_dict
    from harness.recipes import full_many

    with opt.resident():
        out = {f"param/{k}": v.detach().float().clone() for k, v in full_state_dict(model).items()}
        masters = opt.masters()
        out |= {f"master/{k}": v.clone() for k, v in full_many(masters).items()}
        for fqn, m in masters.items():
            for k, v in full_many({k: v for k, v in opt.inner.state.get(m, {}).items()}).items():
                out[f"state/{fqn}/{k}"] = v.clone()
    return out


def _job(layout: str, shape: str, tier: str | None, base: str, dtype: str):
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.store import SwapDir, Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.app.config import TrainConfig
    from meshlm.layout.precision import shard_dtypes
    from harness.recipes import full_many

    torch._dynamo.reset()
    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(shape)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    kw = shard_dtypes(TrainConfig(param_dtype=dtype), meshlm.load_layout(layout), sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0, **kw)
    swap = None
    if tier is not None:
        rank = torch.distributed.get_rank()
        swap = Swapper(tier, SwapDir(base, rank, run_id="t") if tier == "disk" else None)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload=swap)
    record = {"loss": [], "grad": [], "state": [], "out_bytes": [], "files": []}
    for micro in _batches(cfg.vocab):
        for x, y in micro:
            loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh)) / ACCUM
            loss.backward()
            record["loss"].append(float(loss))
        opt.reduce_grads()
        record["grad"].append(
            {k: g.clone() for k, g in full_many({k: m.grad for k, m in opt.masters().items()}).items()}
        )
        opt.step()
        opt.zero_grad()
        if swap is not None:  # between steps: every offloaded tensor is out, holding 0 bytes
            ts = opt.offload.tensors(opt.offload.pairs())
            record["out_bytes"].append([t.untyped_storage().nbytes() for t in ts if swap.is_out(t)])
            record["n_tensors"] = len(ts)
            record["n_out"] = sum(swap.is_out(t) for t in ts)
            if swap.disk is not None:
                record["files"].append(sorted(f for f in os.listdir(swap.disk.path) if f.endswith(".bin")))
        record["state"].append(_state(model, opt))
    if swap is not None and swap.disk is not None:
        swap.disk.close()
        record["after_close"] = os.path.exists(swap.disk.path)
    return record


def _same(a: dict, b: dict, what: str) -> None:
    assert a["loss"] == b["loss"], what
    for k in range(STEPS):
        for kind in ("grad", "state"):
            assert sorted(a[kind][k]) == sorted(b[kind][k]), (what, kind)
            for n, v in a[kind][k].items():
                assert torch.equal(v, b[kind][k][n]), f"{what}: step {k + 1} {kind} {n} differs"


CASES = [
    (1, "single", "dp=1", "float32"),
    (2, "fsdp", "fsdp=2", "float32"),
    (2, "zero1", "dp=2", "bfloat16"),
    (4, "fsdp_tp", "fsdp=2,tp=2", "float32"),
]


@pytest.mark.parametrize("world,layout,shape,dtype", CASES)
def test_disk_offload_equals_no_offload(world, layout, shape, dtype, tmp_path, pool1, pool2, pool4):
    pool = {1: pool1, 2: pool2, 4: pool4}[world]
    base = pool.run(_job, layout, shape, None, str(tmp_path), dtype)
    off = pool.run(_job, layout, shape, "disk", str(tmp_path), dtype)
    for r in range(world):
        _same(off[r], base[r], f"{layout} {shape} {dtype} rank {r}")
        # every offloaded tensor was out between steps, holding no memory, its bytes in a file
        assert off[r]["n_out"] == off[r]["n_tensors"] > 0
        assert all(n == 0 for step in off[r]["out_bytes"] for n in step)
        assert len(off[r]["files"][-1]) == off[r]["n_tensors"]
        assert off[r]["after_close"] is False  # the rank's swap directory is gone
    if dtype == "bfloat16":  # the fp32 masters are tensors of their own and moved too
        assert off[0]["n_tensors"] > 2 * len([k for k in off[0]["state"][0] if k.startswith("master/")])


def test_host_offload_on_cpu_moves_nothing_and_equals(tmp_path, pool2):
    base = pool2.run(_job, "fsdp", "fsdp=2", None, str(tmp_path), "float32")
    host = pool2.run(_job, "fsdp", "fsdp=2", "host", str(tmp_path), "float32")
    for r in range(2):
        _same(host[r], base[r], f"host rank {r}")
        assert host[r]["n_out"] == 0 and host[r]["n_tensors"] > 0  # the device is host memory here
