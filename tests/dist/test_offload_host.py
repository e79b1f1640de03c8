"""The optimizer step on the host (NOTE [host step] in meshlm/runtime/offload/host_step.py), run on
CPU through a swapper that simulates an accelerator (``Swapper("host", simulate=True)``:
host copies are made and the "device" storage freed, as on a GPU).  The same layout with and
without it gives the same losses, gradients, weights and AdamW state after three steps with
gradient accumulation, bit for bit, on 1, 2 and 4 gloo processes, with bf16 storage over
float32 masters under ZeRO-1 too (masters of their own, stepped in their host copies).
Between steps every state tensor holds 0 bytes on the device; a step moves exactly this
rank's gradients down and its parameters up (never the state); a parameter changed between
steps (as a checkpoint load does) is read again."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

from test_offload import CASES  # the layouts the disk tier's parity runs under

pool1 = dist_pool_fixture(1, timeout_s=90)
pool2 = dist_pool_fixture(2, timeout_s=90)
pool4 = dist_pool_fixture(4, timeout_s=90)

STEPS, ACCUM = 3, 2


def _job(layout: str, shape: str, host: bool, dtype: str):
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.runtime.lowering import full_state_dict
    from meshlm.runtime.memory import local_data
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.store import Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.layout.precision import shard_dtypes
    from harness.recipes import full_many
    from harness.setup import accumulation_batches

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(shape)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    kw = shard_dtypes(TrainConfig(param_dtype=dtype), meshlm.load_layout(layout), sizes)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0, **kw)
    swap = Swapper("host", simulate=True) if host else None
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload=swap)
    rec = {"loss": [], "grad": [], "state": [], "host": opt.offload is not None and opt.offload.host is not None}
    for k, micro in enumerate(accumulation_batches(cfg.vocab, STEPS, ACCUM, seed=3)):
        if k == 2:  # changed outside the step (a checkpoint load does so): the host step reads it again
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        for x, y in micro:
            loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh)) / ACCUM
            loss.backward()
            rec["loss"].append(float(loss))
        opt.reduce_grads()
        grads = {f: m.grad for f, m in opt.masters().items()}
        rec["grad"].append({f: g.clone() for f, g in full_many(grads).items()})
        if swap is not None:
            moved = (swap.bytes_in, swap.bytes_out)
            grad_bytes = sum(local_data(g).numel() * local_data(g).element_size() for g in grads.values() if g is not None)
        opt.step()
        opt.zero_grad()
        if swap is not None:
            state = [
                local_data(v) for m in opt.masters().values() for v in opt.inner.state.get(m, {}).values()
                if torch.is_tensor(v) and v.ndim > 0
            ]
            rec.setdefault("state_bytes", []).append([t.untyped_storage().nbytes() for t in state])
            rec.setdefault("state_out", []).append(all(swap.host_of(t) is not None for t in state) and len(state) > 0)
            p_bytes = sum(local_data(p).numel() * local_data(p).element_size() for p in model.parameters())
            rec.setdefault("moved", []).append((swap.bytes_in - moved[0], swap.bytes_out - moved[1], p_bytes, grad_bytes))
        with opt.resident():
            st = {f"param/{n}": v.detach().float().clone() for n, v in full_state_dict(model).items()}
            for f, m in opt.masters().items():
                st |= {f"state/{f}/{n}": v.clone() for n, v in full_many(dict(opt.inner.state.get(m, {}))).items()}
        rec["state"].append(st)
    return rec


@pytest.mark.parametrize("world,layout,shape,dtype", CASES)
def test_host_step_equals_the_step_on_the_device(world, layout, shape, dtype, pool1, pool2, pool4):
    pool = {1: pool1, 2: pool2, 4: pool4}[world]
    base = pool.run(_job, layout, shape, False, dtype)
    host = pool.run(_job, layout, shape, True, dtype)
    for r in range(world):
        a, b = host[r], base[r]
        assert a["host"] and not b["host"]
        assert a["loss"] == b["loss"]
        for k in range(STEPS):
            for kind in ("grad", "state"):
                assert sorted(a[kind][k]) == sorted(b[kind][k])
                for n, v in a[kind][k].items():
                    assert torch.equal(v, b[kind][k][n]), f"{layout} rank {r} step {k + 1}: {kind} {n} differs"
        # between steps the state is on the host only
        assert all(a["state_out"]) and all(n == 0 for step in a["state_bytes"] for n in step)
        # each step moves the gradients down and the parameters up, nothing else; the first
        # step (and the one after the parameters were changed) reads the parameters too
        up, down, p_bytes, g_bytes = a["moved"][1]
        assert up == p_bytes or dtype == "bfloat16"  # ZeRO-1's masters come up as bf16 shards, not whole
        assert down == g_bytes
        first_down, third_down = a["moved"][0][1], a["moved"][2][1]
        if dtype == "float32":
            assert first_down == third_down == g_bytes + p_bytes
