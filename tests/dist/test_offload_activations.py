"""Activations offloaded to disk (NOTE [offloaded activations] in meshlm/runtime/offload/activations.py):
the same forward and backward with and without ``offload.activations=disk`` give the same
loss and every gradient bit for bit, eager and compiled per block (aot_eager), with and
without activation checkpointing; between forward and backward the saved activations are
files (and gone after backward)."""

from __future__ import annotations

import os

import pytest
import torch

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=120)


def _job(layout: str, shape: str, base: str, compile: str, ckpt: str, offload: bool):
    import meshlm
    import meshlm.runtime.compile
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.lowering import full_state_dict
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.store import SwapDir
    from meshlm.runtime.offload.activations import ActivationOffload
    from harness.recipes import full_many

    torch._dynamo.reset()
    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    apply_activation_checkpointing(model, ckpt)
    if compile != "none":
        meshlm.runtime.compile.compile_blocks(model, compile)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, cfg.vocab, (8, 32), generator=g), torch.randint(0, cfg.vocab, (8, 32), generator=g)
    disk = SwapDir(base, torch.distributed.get_rank(), run_id=f"a{int(offload)}") if offload else None
    act = ActivationOffload("disk" if offload else "device", disk, min_bytes=1024)
    out = {}
    for step in range(2):  # the second pass runs the compiled blocks' cached graphs
        with act.context():
            loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh))
        out["files_between"] = len(os.listdir(act.dir)) if offload else 0
        loss.backward()
        out["files_after"] = len(os.listdir(act.dir)) if offload else 0
        out["loss"] = float(loss)
        out["grads"] = {k: v.clone() for k, v in full_many({n: p.grad for n, p in model.named_parameters()}).items()}
        model.zero_grad()
    out["moved"] = act.moved_bytes
    out["n_params"] = len(full_state_dict(model))
    if disk is not None:
        disk.close()
    return out


@pytest.mark.parametrize(
    "layout,shape,compile,ckpt",
    [
        ("fsdp", "fsdp=2", "none", "none"),
        ("tp", "tp=2", "none", "none"),
        ("fsdp", "fsdp=2", "aot_eager", "none"),
        ("fsdp_tp", "fsdp=2", "none", "full"),
    ],
)
def test_disk_activations_equal_in_memory(layout, shape, compile, ckpt, tmp_path, pool2):
    base = pool2.run(_job, layout, shape, str(tmp_path), compile, ckpt, False)
    off = pool2.run(_job, layout, shape, str(tmp_path), compile, ckpt, True)
    for r in range(2):
        assert off[r]["loss"] == base[r]["loss"]
        assert sorted(off[r]["grads"]) == sorted(base[r]["grads"])
        for n, g in base[r]["grads"].items():
            assert torch.equal(off[r]["grads"][n], g), f"rank {r}: gradient of {n} differs"
        assert off[r]["files_between"] > 0 and off[r]["moved"] > 0  # saved activations were on disk
        assert off[r]["files_after"] == 0  # and backward read (and removed) every one
