"""Offloaded parameters (NOTE [offloaded parameters] in meshlm/runtime/offload/params.py): each
block's stored parameters on disk between uses give the same losses, gradients, weights and
AdamW state after three steps of two accumulated micro-batches as the same run without, bit
for bit, on 1, 2 and 4 gloo processes: under ZeRO-3 (the stored shard re-gathered in
backward), tensor parallel and ddp (the stored weight saved by autograd for backward),
compiled per block (aot_eager), under full activation checkpointing (the recompute inside
backward), and with the optimizer state on disk too.  Between steps, and after a forward
without autograd, every block parameter is out (0 bytes); the next block's are read ahead.
The model is built onto the tier as ``meshlm train`` builds it (``meshlm.shard(...,
after_block=...)``): each block's parameters leave memory before the next block's are made."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

pool1 = dist_pool_fixture(1, timeout_s=120)
pool2 = dist_pool_fixture(2, timeout_s=120)
pool4 = dist_pool_fixture(4, timeout_s=120)

STEPS, ACCUM = 3, 2


def _run(layout, shape, base, compile, ckpt, params, optimizer):
    import meshlm
    import meshlm.runtime.compile
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.lowering import full_state_dict
    from meshlm.models import Llama, llama_config
    from meshlm.core.annotate import outer_blocks
    from meshlm.runtime.memory import local_data
    from meshlm.runtime.offload.params import ParamOffload
    from meshlm.runtime.offload.store import SwapDir, Swapper, owns_storage
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from harness.recipes import full_many

    torch._dynamo.reset()
    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(shape)
    rank = torch.distributed.get_rank()
    disk = SwapDir(base, rank, run_id=f"p{int(params)}{int(optimizer)}") if params or optimizer else None
    pswap = Swapper("disk", disk) if params else None
    meta = Llama(cfg, device="meta")
    built = []  # after each block is made: bytes in memory of the block parameters made so far

    def spill(blk):  # as meshlm train builds with offloaded parameters (Offload.spill)
        for p in blk.parameters():
            if owns_storage(local_data(p)):
                pswap.swap_out(local_data(p))
        made = [local_data(p) for b in outer_blocks(meta) for p in b.parameters() if not p.is_meta]
        built.append((len(made), sum(t.untyped_storage().nbytes() for t in made)))

    # the library's other path (tp here): a model built whole, its blocks moved out afterwards
    model = meshlm.shard(meta, layout, mesh, seed=0, after_block=spill if params and layout != "tp" else None)
    apply_activation_checkpointing(model, ckpt)
    if compile != "none":
        meshlm.runtime.compile.compile_blocks(model, compile)
    poff = ParamOffload(model, pswap) if params else None
    opt = ShardedOptimizer(
        model,
        torch.optim.AdamW,
        lr=1e-2,
        weight_decay=0.1,
        offload=Swapper("disk", disk) if optimizer else None,
        offload_params=poff,
    )

    def held():  # bytes the managed block parameters hold now
        return sum(t.untyped_storage().nbytes() for g in poff.groups for t in g) if poff else None

    g = torch.Generator().manual_seed(11)
    rec = {"loss": [], "grads": [], "state": [], "held": [], "built": built, "blocks": len(outer_blocks(model))}
    for _step in range(STEPS):
        for _ in range(ACCUM):
            x, y = (torch.randint(0, cfg.vocab, (4, 16), generator=g) for _ in range(2))
            loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh)) / ACCUM
            loss.backward()
            rec["loss"].append(float(loss))
        opt.reduce_grads()
        rec["grads"].append(full_many({k: m.grad for k, m in opt.masters().items()}))
        opt.step()
        opt.zero_grad()
        rec["held"].append(held())
        with opt.resident():
            state = {f"p/{k}": v.detach().clone() for k, v in full_state_dict(model).items()}
            for fqn, m in opt.masters().items():
                state |= {f"s/{fqn}/{k}": v for k, v in full_many(dict(opt.inner.state[m])).items()}
        rec["state"].append(state)
        rec["held_after_resident"] = held()
    with torch.no_grad():  # validation: in for each block's forward, out after it
        model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh))
    rec["held_after_eval"] = held()
    rec["prefetched"] = poff.prefetched if poff else 0
    rec["n_params"] = sum(len(g) for g in poff.groups) if poff else 0
    if disk is not None:
        disk.close()
    return rec


def _job(layout, shape, base, compile, ckpt, optimizer):
    return _run(layout, shape, base, compile, ckpt, False, False), _run(
        layout, shape, base, compile, ckpt, True, optimizer
    )


CASES = [
    (1, "single", "dp=1", "none", "none", False),
    (2, "fsdp", "fsdp=2", "none", "none", True),
    (2, "tp", "tp=2", "none", "none", False),
    (2, "ddp", "dp=2", "aot_eager", "none", False),
    (2, "fsdp", "fsdp=2", "none", "full", False),
    (4, "fsdp_tp", "fsdp=2,tp=2", "none", "none", False),
]


@pytest.mark.parametrize("world,layout,shape,compile,ckpt,optimizer", CASES)
def test_offloaded_parameters_equal_no_offload(
    world, layout, shape, compile, ckpt, optimizer, tmp_path, pool1, pool2, pool4
):
    pool = {1: pool1, 2: pool2, 4: pool4}[world]
    for r, (base, off) in enumerate(pool.run(_job, layout, shape, str(tmp_path), compile, ckpt, optimizer)):
        what = f"{layout} {shape} compile={compile} ckpt={ckpt} rank {r}"
        assert off["loss"] == base["loss"], what
        for k in range(STEPS):
            for kind in ("grads", "state"):
                assert sorted(off[kind][k]) == sorted(base[kind][k]), (what, kind)
                for n, v in base[kind][k].items():
                    assert torch.equal(off[kind][k][n], v), f"{what}: step {k + 1} {kind} {n} differs"
        assert off["n_params"] > 0
        assert off["held"] == [0] * STEPS and off["held_after_resident"] == 0 and off["held_after_eval"] == 0
        assert off["prefetched"] > 0  # the next block's parameters were read ahead
        if layout != "tp":  # built onto the tier: each block's out before the next block's were made
            assert len(off["built"]) == off["blocks"] > 1
            assert [n for n, _b in off["built"]] == sorted({n for n, _b in off["built"]}) and off["built"][0][0] > 0
            assert all(nbytes == 0 for _n, nbytes in off["built"]), off["built"]


def _refused(shape):
    import meshlm
    from meshlm.core.errors import ConfigError
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.params import ParamOffload
    from meshlm.runtime.offload.store import Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(shape)
    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "zero2", mesh, seed=0)
    try:
        ShardedOptimizer(model, torch.optim.AdamW, offload_params=ParamOffload(model, Swapper("host")))
    except ConfigError as e:
        return str(e)
    return None


def test_a_layout_whose_optimizer_keeps_copies_is_refused(pool2):
    msg = pool2.run(_refused, "dp=2")[0]
    assert msg is not None and msg.startswith("offload.params=host: the optimizer keeps a copy of parameter `layers.0.")
    assert "Use a layout that updates parameters in place" in msg
