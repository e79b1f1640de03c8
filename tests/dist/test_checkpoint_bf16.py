"""Checkpoints of mixed-precision runs (docs/checkpoint.md, "Mixed precision").

Under ``train.param_dtype=bfloat16`` ZeRO-1/2 store bf16 parameters and keep the true
weights in the optimizer's sharded float32 masters (NOTE [mixed precision] in
meshlm/layout/precision.py).  A checkpoint saves those masters, and every load takes the weights
from them (or, from a checkpoint without masters, from the saved parameters) in float32:

* a resumed bf16 ZeRO-1/2 run continues bit for bit as if never stopped (same world
  size and layout: no reordering), like the fp32 resume of test_checkpoint_crash.py;
* under another layout, world size or ``param_dtype`` the loaded masters, and the
  parameters of fp32 storage, equal the saved masters exactly, bf16 parameters are them
  rounded, the AdamW state is moved unchanged, and the continued losses stay within the
  resharding tolerance of test_checkpoint_reshard.py where the compute dtype is the same;
* an fp32 checkpoint loaded into bf16 ZeRO takes its masters from the fp32 parameters,
  not from their bf16 rounding;
* main gradients are never saved, and a load drops any that are pending.

2 gloo processes (1 for the world-size change), llama_tiny, 2 micro-batches per step.
"""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)

# The same tolerance as test_checkpoint_reshard.py: another layout sums in another order.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
BEFORE, AFTER, ACCUM = 2, 2, 2


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (8, 17), generator=g) for _ in range(n * ACCUM)]


def _setup(layout: str, shape: str, param_dtype: str):
    """llama_tiny sharded as ``meshlm train`` shards it for ``train.param_dtype``."""
    import meshlm
    from meshlm.app.config import TrainConfig
    from meshlm.layout.mesh import mesh_spec
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.app.train import shard_dtypes

    mesh = meshlm.make_mesh(shape)
    lay = meshlm.load_layout(layout)
    kw = shard_dtypes(TrainConfig(param_dtype=param_dtype), lay, mesh_spec(mesh).as_dict())
    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), lay, mesh, seed=0, **kw)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return mesh, model, opt


def _micro(model, layout, mesh, toks):
    import meshlm

    x, y = meshlm.shard_batch(toks[:, :-1], layout, mesh), meshlm.shard_batch(toks[:, 1:], layout, mesh)
    loss = model(x, y)
    (loss / ACCUM).backward()
    return float(loss)


def _train(model, opt, layout, mesh, batches, steps: range) -> list[float]:
    out = []
    for s in steps:
        out.append(sum(_micro(model, layout, mesh, batches[s * ACCUM + k]) for k in range(ACCUM)) / ACCUM)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    return out


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter (in its storage dtype), master and AdamW state tensor, gathered."""
    from torch.distributed.tensor import DTensor

    from meshlm.runtime.lowering import full_state_dict

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model/{k}": v.clone() for k, v in full_state_dict(model).items()}
    for fqn, m in opt.masters().items():
        out[f"master/{fqn}"] = full(m)
        for k, v in opt.inner.state.get(m, {}).items():
            out[f"optim/{fqn}/{k}"] = full(v)
    return out


def _job(layout, shape, param_dtype, load_from=None, save_to=None):
    """Train BEFORE steps and save to ``save_to`` (or load ``load_from``), then train AFTER
    more: the state right after the save or load, the losses after it, the final state,
    and the storage dtype."""
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint

    batches = _batches(BEFORE + AFTER)
    mesh, model, opt = _setup(layout, shape, param_dtype)
    if load_from is None:
        _train(model, opt, layout, mesh, batches, range(BEFORE))
        save_checkpoint(save_to, BEFORE, model=model, optimizer=opt, extra={"step": BEFORE})
    else:
        assert load_checkpoint(load_from, model=model, optimizer=opt)["step"] == BEFORE
    state = _state(model, opt)
    after = _train(model, opt, layout, mesh, batches, range(BEFORE, BEFORE + AFTER))
    return {"state": state, "after": after, "final": _state(model, opt),
            "dtype": str(next(iter(model.parameters())).dtype)}


def _saved_keys(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(path).read_metadata().state_dict_metadata)


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        _equal(got[k], v, f"{what}: {k}")


def _weights_follow_masters(got: dict, want: dict, what: str, optimizer: bool = True) -> None:
    """``got`` (loaded) against ``want`` (saved): masters and optimizer state equal (with an
    ``optimizer``), each parameter the saved master in the parameter's own dtype (fp32
    storage: the master)."""
    for k, v in want.items():
        if k.startswith("model/") or not optimizer:
            continue
        _equal(got[k], v, f"{what}: {k}")
    for k, p in got.items():
        if k.startswith("model/"):
            master = want["master/" + k[len("model/"):]]
            _equal(p, master.to(p.dtype), f"{what}: {k}")


@pytest.fixture(scope="module")
def saved_bf16(tmp_path_factory, pool2):
    """bf16 ZeRO-2 on dp=2: BEFORE steps, a checkpoint, AFTER more."""
    d = str(tmp_path_factory.mktemp("bf16_zero2"))
    a = pool2.run(_job, "zero2", "dp=2", "bfloat16", save_to=d)[0]
    assert a["dtype"] == "torch.bfloat16"
    return f"{d}/step_{BEFORE:08d}", a


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_bf16_zero_resumes_exactly(pool2, tmp_path, saved_bf16, layout):
    """Same layout and world size: the state right after the load is the saved one, bit
    for bit (bf16 parameters, fp32 masters, AdamW state), and so are the losses of the
    steps after it and the final state.  The checkpoint holds the fp32 masters."""
    if layout == "zero2":
        path, a = saved_bf16
    else:
        a = pool2.run(_job, layout, "dp=2", "bfloat16", save_to=str(tmp_path))[0]
        path = f"{tmp_path}/step_{BEFORE:08d}"
    keys = _saved_keys(path)
    assert any(k.startswith("master/") for k in keys) and len([k for k in keys if k.startswith("master/")]) == \
        len([k for k in keys if k.startswith("model/")]), keys
    b = pool2.run(_job, layout, "dp=2", "bfloat16", load_from=path)[0]
    assert b["dtype"] == "torch.bfloat16"
    _same(b["state"], a["state"], f"{layout} resume: loaded state")
    assert b["after"] == a["after"], f"{layout}: losses after resume {b['after']} != uninterrupted {a['after']}"
    _same(b["final"], a["final"], f"{layout} resume: final state")


@pytest.mark.parametrize("layout,shape,param_dtype", [("zero1", "dp=2", "bfloat16"), ("fsdp", "fsdp=2", "bfloat16"),
                                                      ("zero2", "dp=2", "float32")])
def test_bf16_checkpoint_reshards_to_masters(pool2, saved_bf16, layout, shape, param_dtype):
    """bf16 ZeRO-2 -> bf16 ZeRO-1, fsdp (fp32 storage: the parameters are the masters), and
    a float32 run: the masters loaded are the saved ones exactly, never the bf16
    parameters widened."""
    path, a = saved_bf16
    b = pool2.run(_job, layout, shape, param_dtype, load_from=path)[0]
    _weights_follow_masters(b["state"], a["state"], f"bf16 zero2 -> {param_dtype} {layout} {shape}")
    if param_dtype == "bfloat16":  # the same bf16 compute: only the order of the fp32 sums differs
        torch.testing.assert_close(torch.tensor(b["after"]), torch.tensor(a["after"]), **LOSS_TOL)


def _weights_only_job(path):
    """An fp32 model loaded without an optimizer, as ``meshlm convert`` exports one."""
    import meshlm
    from meshlm.train.checkpoint import load_checkpoint
    from meshlm.runtime.lowering import full_state_dict
    from meshlm.models import Llama, llama_config

    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "single", meshlm.make_mesh("dp=1"))
    load_checkpoint(path, model=model, optimizer=None, restore_rng=False)
    return {f"model/{k}": v for k, v in full_state_dict(model).items()}


def test_bf16_checkpoint_to_one_process(saved_bf16, pool1):
    """bf16 ZeRO-2 on 2 ranks -> 1 rank, where ZeRO-2 shards nothing and stores fp32; and
    the weights alone into an fp32 model (``meshlm convert``): the saved masters."""
    path, a = saved_bf16
    b = pool1.run(_job, "zero2", "dp=1", "bfloat16", load_from=path)[0]
    weights = pool1.run(_weights_only_job, path)[0]
    assert b["dtype"] == "torch.float32"
    _weights_follow_masters(b["state"], a["state"], "bf16 zero2 dp=2 -> dp=1")
    torch.testing.assert_close(torch.tensor(b["after"]), torch.tensor(a["after"]), **LOSS_TOL)
    _weights_follow_masters(weights, a["state"], "bf16 zero2 -> weights only, fp32", optimizer=False)


def test_fp32_checkpoint_into_bf16_zero(pool2, tmp_path):
    """An fp32 checkpoint (no masters saved: its parameters are the weights) loads into bf16
    ZeRO-2 with its masters equal to the saved fp32 parameters, not their bf16 rounding."""
    a = pool2.run(_job, "zero2", "dp=2", "float32", save_to=str(tmp_path))[0]
    assert a["dtype"] == "torch.float32"
    path = f"{tmp_path}/step_{BEFORE:08d}"
    assert not any(k.startswith("master/") for k in _saved_keys(path))
    b = pool2.run(_job, "zero2", "dp=2", "bfloat16", load_from=path)[0]
    assert b["dtype"] == "torch.bfloat16"
    _weights_follow_masters(b["state"], a["state"], "fp32 zero2 -> bf16 zero2")


def _mid_accumulation_job(layout, d):
    """Save and load with main gradients pending (a micro-batch's backward done, its step
    not): the save leaves them alone and the step completes as if it had not happened; a
    load drops them (they are gradients of the weights it replaces).  Returns the losses
    and final states of: the uninterrupted run, the run that saved mid-step, and the run
    that loaded with stale main gradients."""
    from meshlm.runtime import main_grad
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint

    batches = _batches(BEFORE + AFTER)
    mesh, model, opt = _setup(layout, "dp=2", "bfloat16")
    _train(model, opt, layout, mesh, batches, range(BEFORE))
    save_checkpoint(d, BEFORE, model=model, optimizer=opt, extra={"step": BEFORE})
    # the next step's first micro-batch, then a save between the two micro-batches
    first = _micro(model, layout, mesh, batches[BEFORE * ACCUM])
    pending = sum(main_grad.get(p) is not None for p in model.parameters())
    save_checkpoint(f"{d}/mid", BEFORE, model=model, optimizer=opt, extra={"step": BEFORE})
    second = _micro(model, layout, mesh, batches[BEFORE * ACCUM + 1])
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    mid = [(first + second) / ACCUM] + _train(model, opt, layout, mesh, batches, range(BEFORE + 1, BEFORE + AFTER))
    mid_final = _state(model, opt)
    # a fresh run: a backward (main gradients pending), then the load of the step checkpoint
    mesh, model, opt = _setup(layout, "dp=2", "bfloat16")
    _micro(model, layout, mesh, batches[0])
    load_checkpoint(f"{d}/step_{BEFORE:08d}", model=model, optimizer=opt)
    stale = sum(main_grad.get(p) is not None for p in model.parameters())
    loaded = _train(model, opt, layout, mesh, batches, range(BEFORE, BEFORE + AFTER))
    return {"pending": pending, "stale": stale, "mid": mid, "mid_final": mid_final, "loaded": loaded,
            "loaded_final": _state(model, opt), "keys": _saved_keys(f"{d}/mid/step_{BEFORE:08d}"),
            "step_keys": _saved_keys(f"{d}/step_{BEFORE:08d}")}


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_main_grads_are_not_checkpointed(pool2, tmp_path, saved_bf16, layout):
    r = pool2.run(_mid_accumulation_job, layout, str(tmp_path))[0]
    assert r["pending"] > 0, "no main gradient was pending: the test saves at the wrong moment"
    assert r["keys"] == r["step_keys"], "a save mid-accumulation wrote other tensors than one at a step boundary"
    assert r["stale"] == 0, f"{r['stale']} main gradients of the replaced weights survived the load"
    if layout == "zero2":  # the run saved_bf16 trained, uninterrupted
        _path, a = saved_bf16
        assert r["mid"] == a["after"], "saving mid-accumulation changed the step"
        assert r["loaded"] == a["after"], "stale main gradients leaked into the step after the load"
        _same(r["mid_final"], a["final"], "saved mid-accumulation")
        _same(r["loaded_final"], a["final"], "loaded over pending main gradients")
    else:
        assert r["mid"] == r["loaded"]
        _same(r["loaded_final"], r["mid_final"], "loaded over pending main gradients")
