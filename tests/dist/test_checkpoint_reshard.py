"""Resharding: a checkpoint saved under one layout and mesh loads under another.

fsdp on 4 ranks -> fsdp_tp on 2x2 -> tp on 2 -> single process (and zero1 -> fsdp, and
between fsdp_cp on fsdp=2 x cp=2 and fsdp on 4, both ways: docs/cp.md), each
hop comparing every parameter and optimizer-state tensor with the saved ones (exactly: a
reshard moves bytes, it does no arithmetic) and the continued losses with the run that
never resharded (fp32 layout-invariance tolerance)."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

# Continuing on another layout changes the reduction order of matmuls and all-reduces, so
# losses differ by fp32 rounding only: the same tolerance as layout parity (a few ulps of
# loss ~5.5 after a handful of AdamW steps at lr 1e-2).
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _batches(n: int):
    from meshlm.models import llama_config

    cfg = llama_config("llama_tiny")
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, cfg.vocab, (8, 16), generator=g), torch.randint(0, cfg.vocab, (8, 16), generator=g))
        for _ in range(n)
    ]


def _setup(layout: str, shape: str):
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(shape)
    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), layout, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return mesh, model, opt


def _train(model, opt, layout, mesh, batches) -> list[float]:
    import meshlm

    out = []
    for x, y in batches:
        loss = model(meshlm.shard_batch(x, layout, mesh), meshlm.shard_batch(y, layout, mesh))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from meshlm.runtime.lowering import full_state_dict

    # clone: full_tensor() of a replicated DTensor is its local tensor, which training mutates
    out = {f"model/{k}": v.clone() for k, v in full_state_dict(model).items()}
    for fqn, m in opt.masters().items():
        for k, v in opt.inner.state.get(m, {}).items():
            out[f"optim/{fqn}/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _job(layout, shape, load_from, save_to, n_before, n_after):
    """Train ``n_before`` steps (or load ``load_from``), save to ``save_to``, train
    ``n_after`` more; return the full state right after the load/save and the losses."""
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint

    batches = _batches(STEPS_BEFORE + STEPS_AFTER)
    mesh, model, opt = _setup(layout, shape)
    before = []
    if load_from is None:
        before = _train(model, opt, layout, mesh, batches[:n_before])
        step = n_before
    else:
        extra = load_checkpoint(load_from, model=model, optimizer=opt)
        step = extra["step"]
    state = _full_state(model, opt)
    path = (
        save_checkpoint(
            save_to, step, model=model, optimizer=opt, extra={"step": step}, run_meta={"layout": layout, "mesh": shape}
        )
        if save_to
        else None
    )
    after = _train(model, opt, layout, mesh, batches[step : step + n_after])
    return {"state": state, "before": before, "after": after, "path": path}


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        # exact: resharding is data movement only
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m: f"{what}: {k}: {m}")


pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)


def test_reshard_fsdp4_fsdptp_tp2_single(tmp_path, pool4, pool2, pool1):
    d = str(tmp_path)
    a = pool4.run(_job, "fsdp", "fsdp=4", None, f"{d}/a", STEPS_BEFORE, STEPS_AFTER)[0]
    b = pool4.run(_job, "fsdp_tp", "fsdp=2,tp=2", a["path"], f"{d}/b", 0, STEPS_AFTER)[0]
    _assert_same_state(b["state"], a["state"], "fsdp=4 -> fsdp_tp 2x2")
    torch.testing.assert_close(torch.tensor(b["after"]), torch.tensor(a["after"]), **LOSS_TOL)
    c = pool2.run(_job, "tp", "tp=2", b["path"], f"{d}/c", 0, STEPS_AFTER)[0]
    _assert_same_state(c["state"], a["state"], "fsdp_tp 2x2 -> tp=2")
    torch.testing.assert_close(torch.tensor(c["after"]), torch.tensor(a["after"]), **LOSS_TOL)
    s = pool1.run(_job, "single", "dp=1", c["path"], None, 0, STEPS_AFTER)[0]
    _assert_same_state(s["state"], a["state"], "tp=2 -> single process")
    torch.testing.assert_close(torch.tensor(s["after"]), torch.tensor(a["after"]), **LOSS_TOL)


@pytest.mark.parametrize(
    "src,dst",
    [
        (("zero1", "dp=4"), ("fsdp", "fsdp=4")),
        (("fsdp", "fsdp=4"), ("zero2", "dp=4")),
        # context parallel: parameters are stored over fsdp and replicated over cp
        (("fsdp_cp", "fsdp=2,cp=2"), ("fsdp", "fsdp=4")),
        (("fsdp", "fsdp=4"), ("fsdp_cp", "fsdp=2,cp=2")),
    ],
)
def test_reshard_one_hop(tmp_path, src, dst, pool4):
    d = str(tmp_path)
    a = pool4.run(_job, src[0], src[1], None, f"{d}/a", STEPS_BEFORE, STEPS_AFTER)[0]
    b = pool4.run(_job, dst[0], dst[1], a["path"], None, 0, STEPS_AFTER)[0]
    _assert_same_state(b["state"], a["state"], f"{src} -> {dst}")
    torch.testing.assert_close(torch.tensor(b["after"]), torch.tensor(a["after"]), **LOSS_TOL)
