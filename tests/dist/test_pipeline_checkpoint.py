"""Checkpoints of pipelined runs are keyed by the unsharded model's names, so they reshard
like any other: a run saved under fsdp_tp_pp on 8 processes resumes under fsdp on 4 and
the other way round, and one saved at pp=2 x fsdp=2 resumes at pp=4, each continuing with
the losses of a run that never changed layout.  Every stage's parameters and optimizer
state are saved (the resumed run starts from all of them).  Runs go through
``meshlm.app.train.run``, the loop ``meshlm train`` runs, with 2 micro-batches a step.

Tolerance: NOTE [invariance tolerance] in tests/harness/tolerances.py (these are 4 of the
12 steps it is derived for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from meshlm.app.config import RunConfig, from_dict
from harness import dist_pool_fixture
from harness import tolerances as tol

pool4 = dist_pool_fixture(4, timeout_s=60)
pool8 = dist_pool_fixture(8, timeout_s=120)
MODEL = {"_target_": "meshlm.models.llama_model", "name": "llama_tiny", "layers": 4}
MOE = {"_target_": "meshlm.models.moe_model", "vocab": 256, "embed": 64, "layers": 2, "heads": 8, "kv_heads": 4,
       "experts": 8, "top_k": 2, "expert_mlp": 32}  # conf/model/moe_tiny.yaml


def _cfg(layout: str, mesh: dict, steps: int, ckpt: str, resume: bool, model: dict = MODEL) -> RunConfig:
    t = {"steps": steps, "batch_size": 8, "seq_len": 16, "grad_accum": 2, "lr": 3e-3, "min_lr": 3e-3,
         "warmup_steps": 1, "val_every": 0, "val_batches": 1, "progress": False, "count_comm": False,
         "pg_timeout_s": 60}
    # gpipe: pp=4 with the 2 micro-batches every leg takes (1f1b would need 4)
    return from_dict({"model": model, "layout": {"name": layout}, "mesh": mesh, "train": t,
                      "checkpoint": {"dir": ckpt, "resume": "auto" if resume else None},
                      "pipeline": {"schedule": "gpipe" if mesh.get("pp") == 4 else "1f1b"}})


def _run(cfg: RunConfig, run_dir: str) -> list[float]:
    from meshlm.app.train import run

    run(cfg, run_dir)
    dist.barrier()
    return [json.loads(r)["loss"] for r in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _saved_keys(path: str) -> set[str]:
    import torch.distributed.checkpoint as dcp

    from meshlm.train.checkpoint import latest_checkpoint

    return set(dcp.FileSystemReader(latest_checkpoint(path)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def reference(pool4, tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return pool4.run(_run, _cfg("fsdp", {"fsdp": 4}, 4, str(d / "ck"), False), str(d / "run"))[0]


def _close(got, ref):
    assert max(abs(a - b) / b for a, b in zip(got, ref)) <= tol.INVARIANCE_RTOL, (got, ref)


@pytest.mark.parametrize("first,second", [
    (("fsdp_tp_pp", {"fsdp": 2, "tp": 2, "pp": 2}), ("fsdp", {"fsdp": 4})),
    (("fsdp", {"fsdp": 4}), ("fsdp_tp_pp", {"fsdp": 2, "tp": 2, "pp": 2})),
    (("fsdp_pp", {"fsdp": 2, "pp": 2}), ("pp", {"pp": 4})),
    (("fsdp_cp_pp", {"cp": 2, "pp": 2}), ("fsdp", {"fsdp": 4})),
], ids=["fsdp_tp_pp8-to-fsdp4", "fsdp4-to-fsdp_tp_pp8", "pp2xfsdp2-to-pp4", "cp2xpp2-to-fsdp4"])
def test_resume_under_another_layout(pool4, pool8, reference, tmp_path, first, second):
    ck = str(tmp_path / "ck")
    pools = {4: pool4, 8: pool8}
    (l1, m1), (l2, m2) = first, second
    size = lambda m: int(__import__("math").prod(m.values()))  # noqa: E731
    a = pools[size(m1)].run(_run, _cfg(l1, m1, 2, ck, False), str(tmp_path / "a"))[0]
    keys = _saved_keys(ck)
    assert {k for k in keys if k.startswith("model/")} == {f"model/{n}" for n in _param_names()}, keys
    assert all(f"optim/{n}/exp_avg" in keys for n in _param_names())
    b = pools[size(m2)].run(_run, _cfg(l2, m2, 4, ck, True), str(tmp_path / "b"))[0]
    assert len(a) == 2 and len(b) == 2, (a, b)
    _close(a + b, reference)


def test_moe_resume_from_ep_inside_stages_to_fsdp(pool4, tmp_path):
    """A mixture of experts saved under fsdp_ep_pp (ep=2 x pp=2, its auxiliary losses on)
    resumes under fsdp on 4 with the losses of a run that stayed under fsdp."""
    ref = pool4.run(_run, _cfg("fsdp", {"fsdp": 4}, 4, str(tmp_path / "ck0"), False, MOE), str(tmp_path / "r"))[0]
    ck = str(tmp_path / "ck")
    a = pool4.run(_run, _cfg("fsdp_ep_pp", {"pp": 2, "ep": 2}, 2, ck, False, MOE), str(tmp_path / "a"))[0]
    keys = _saved_keys(ck)
    assert {k for k in keys if k.startswith("model/")} == {f"model/{n}" for n in _state_names(MOE)}, keys
    b = pool4.run(_run, _cfg("fsdp", {"fsdp": 4}, 4, ck, True, MOE), str(tmp_path / "b"))[0]
    assert len(a) == 2 and len(b) == 2, (a, b)
    _close(a + b, ref)


def _param_names() -> list[str]:
    from meshlm.app.model_build import build_model
    from meshlm.models.node import ModelConfig

    return [n for n, _ in build_model(ModelConfig.from_dict(MODEL), "meta").named_parameters()]


def _state_names(model: dict) -> list[str]:
    """Parameters and buffers (the experts' selection bias) of ``model``."""
    from meshlm.app.model_build import build_model
    from meshlm.models.node import ModelConfig

    return list(build_model(ModelConfig.from_dict(model), "meta").state_dict())
