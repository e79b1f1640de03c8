"""Plain PyTorch models (tests/usermodel/mymodels/plain.py: torch's layers, weights made in
``__init__``, no ``init_weights``) train as they are: checked against the same model in
plain torch on one process (``check_training``: loss, the gradient each optimizer steps
with, parameters, optimizer state and buffers after 3 steps of SGD and of AdamW with weight
decay) under every shipped layout without pipeline stages on 2 gloo processes, and on the
2-D meshes of 4 (SGD).

NOTE [model build] in meshlm/app/model_plain.py (how ``meshlm train`` builds them), NOTE
[buffers] in meshlm/runtime/lowering/buffers.py (a fixed table, running statistics, a
non-persistent mask; checkpoints), NOTE [ties] in meshlm/core/ties.py (one module in two
blocks).  Tolerances: tests/harness/tolerances.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness import WorkerError, dist_pool_fixture
from harness.parity import TokenBatches, check_training

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

ON_2 = [("single", "dp=2"), ("ddp", "dp=2"), ("zero1", "dp=2"), ("zero2", "dp=2"), ("fsdp", "fsdp=2"),
        ("hsdp", "fsdp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"), ("fsdp_tp", "tp=2"), ("fsdp_tp_sp", "fsdp=2")]
# On 4: the 2-D meshes, where buffers and gradients reduce over one axis of two (a 1-D mesh
# of 4 runs the code of a 1-D mesh of 2, ON_2).
ON_4 = [("zero1", "dp=2,fsdp=2"), ("hsdp", "dp=2,fsdp=2"), ("tp", "dp=2,tp=2"), ("fsdp_tp", "fsdp=2,tp=2"),
        ("fsdp_tp_sp", "fsdp=2,tp=2")]


class Plain:
    """``build`` for check_training: ``torch.manual_seed(seed); cls()`` (picklable)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, device: str, seed: int):
        import mymodels.plain

        torch.manual_seed(seed)
        return getattr(mymodels.plain, self.name)()


def _parity(layout: str, mesh: str, name: str, optims: tuple = ("sgd", "adamw")) -> dict:
    r = check_training(layout, mesh, build=Plain(name), batches=TokenBatches(), from_seed=False, optims=optims)
    return {k: max(v.values()) for k, v in r["worst"].items()} | {"checked": sorted(r["worst"]["sgd"])}


def _ok(results: list) -> None:
    for r in results:
        assert "buffer" in r["checked"], r
        assert all(v <= 1.0 for k, v in r.items() if k != "checked"), r


@pytest.mark.parametrize("layout,mesh", ON_2)
def test_plain_model_trains_as_on_one_device_on_2(pool2, layout, mesh):
    """Real weights from ``__init__``, a sinusoidal table, running statistics averaged over the
    ranks: the buffers too equal the one-device run's after every step."""
    _ok(pool2.run(_parity, layout, mesh, "PlainLM"))


@pytest.mark.parametrize("layout,mesh", ON_4)
def test_plain_model_trains_as_on_one_device_on_4(pool4, layout, mesh):
    """SGD (momentum) only: the meshes of 4 change where gradients and buffers are reduced,
    which the gradient each step takes shows; AdamW's step, elementwise on each shard, runs
    on every layout on 2 above."""
    _ok(pool4.run(_parity, layout, mesh, "PlainLM", ("sgd",)))


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=2"), ("fsdp", "fsdp=2"), ("tp", "tp=2"), ("zero2", "dp=2")])
def test_one_module_in_two_blocks_is_one_weight(pool2, layout, mesh):
    """``blocks.0.up`` is ``blocks.1.up``: one parameter, its gradient the sum of both uses
    (checked against plain torch, where it is that by construction)."""
    _ok(pool2.run(_parity, layout, mesh, "SharedLM"))


def _table(layout: str, mesh: str) -> dict:
    def build(device: str, seed: int):
        from mymodels.plain import TableLM

        from meshlm.core.annotate import init_params

        m = TableLM(device=device)
        if device != "meta":
            init_params(m, seed)
        return m

    r = check_training(layout, mesh, build=build, batches=TokenBatches(), optims=("adamw",))
    return {k: max(v.values()) for k, v in r["worst"].items()} | {"checked": sorted(r["worst"]["adamw"])}


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("tp", "tp=2")])
def test_meta_model_fills_its_buffers_in_init_weights(pool2, layout, mesh):
    """A model built on the meta device: its ``init_weights`` fill its positional table
    (``TableLM.pos``) as they fill its parameters, shard by shard as on one device."""
    _ok(pool2.run(_table, layout, mesh))


def _build(layout: str, mesh: dict, target: str, seed: int) -> dict:
    """``meshlm train``'s build of ``target`` (model_build.build_sharded) against
    ``torch.manual_seed(seed); Model()`` on one device: every parameter and buffer exact."""
    import importlib

    import meshlm
    from meshlm.app.model_build import build_sharded
    from meshlm.models.node import ModelConfig

    model = build_sharded(ModelConfig(target=target), meshlm.load_layout(layout), meshlm.make_mesh(mesh), seed=seed)
    mod, _, cls = target.rpartition(".")
    torch.manual_seed(seed)
    ref = getattr(importlib.import_module(mod), cls)()
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    bufs = dict(model.named_buffers())
    for n, b in ref.named_buffers():
        assert torch.equal(bufs[n], b), n
    return model._meshlm_build


@pytest.mark.parametrize("layout,mesh", [("fsdp", {"fsdp": 4}), ("fsdp_tp", {"fsdp": 2, "tp": 2})])
def test_train_builds_a_plain_model_from_the_seed(pool4, layout, mesh):
    """Built once per host rank by rank, each keeping its shards: the weights are those of
    ``torch.manual_seed(train.seed); Model(**kw)``, and the build says it ran on the host."""
    for r in pool4.run(_build, layout, mesh, "mymodels.plain.PlainLM", 7):
        assert r["how"] == "host" and r["bytes"] > 0, r


def test_too_large_to_build_names_init_weights(pool2):
    with pytest.raises(WorkerError) as e:
        pool2.run(_build, "fsdp", {"fsdp": 2}, "mymodels.plain.HugeLM", 0)
    msg = str(e.value)
    assert "too large to build whole on the host" in msg and "init_weights(generator)" in msg, msg[-2000:]
    assert "`model`" in msg and "`wte`" in msg and "GiB available" in msg, msg[-2000:]


def _save_resume(layout: str, mesh: str, root: str) -> dict:
    """Save after two training forwards, load into a fresh model under ``layout``: the
    persistent buffers come back; the non-persistent mask is not in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    import meshlm
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint
    from harness.parity import TokenBatches

    def fresh():
        return meshlm.shard(Plain("PlainLM")("cpu", 0), layout, meshlm.make_mesh(mesh))

    model = fresh()
    m2 = meshlm.make_mesh(mesh)
    for k in range(2):
        (tokens, targets), _ = TokenBatches()(k, 0)
        model(meshlm.shard_batch(tokens, layout, m2), meshlm.shard_batch(targets, layout, m2)).backward()
    path = save_checkpoint(root, 2, model=model)
    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    other = fresh()
    with torch.no_grad():
        other.mix.fill_(7.0)  # not in the checkpoint: a load leaves it as it is
    load_checkpoint(path, model=other)
    saved = dict(model.named_buffers())
    loaded = dict(other.named_buffers())
    assert int(loaded["batches"]) == 2
    for n in ("pos", "running_mean", "batches", "blocks.0.gain"):
        assert torch.equal(loaded[n], saved[n]), n
    assert bool((loaded["mix"] == 7.0).all())
    return {"keys": sorted(k for k in keys if not k.startswith("model/blocks.") or k.endswith("gain")),
            "running_mean": saved["running_mean"].tolist()}


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=2"), ("tp", "tp=2")])
def test_checkpoint_keeps_persistent_buffers(pool2, tmp_path, layout, mesh):
    """Every rank saves and loads the same buffers (averaged over the ranks, NOTE [buffers])."""
    a, b = pool2.run(_save_resume, layout, mesh, str(tmp_path))
    assert a == b
    assert {"model/pos", "model/running_mean", "model/batches", "model/blocks.0.gain"} <= set(a["keys"])
    assert "model/mix" not in a["keys"]
