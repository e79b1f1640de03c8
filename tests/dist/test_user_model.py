"""A user's model in a package of its own (tests/usermodel/mymodels, not meshlm.*), named by
``model._target_`` with no change to meshlm: it trains under every shipped layout through
``meshlm.app.train.run`` (the loop ``meshlm train`` runs) with the loss curve of the one-device
layout, and breaks of the model contract stop the run with the error that names them.  The
command itself runs once in tests/dist/test_train_cli.py::test_train_user_model.

Tolerances: NOTE [invariance tolerance] in tests/harness/tolerances.py (these are 2 of the
12 steps it is derived for: the second step runs on weights the first moved)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from meshlm.app.config import RunConfig, from_dict
from meshlm.layout.rules import load_layout, shipped_layouts
from harness import WorkerError, dist_pool_fixture
from harness import tolerances as tol

USERMODEL = str(Path(__file__).resolve().parents[1] / "usermodel")
if USERMODEL not in sys.path:  # here and in the pool's workers, which import this module
    sys.path.insert(0, USERMODEL)

pool4 = dist_pool_fixture(4, timeout_s=60)
STEPS = 2
MESHES = {"ddp": {"dp": 4}, "zero1": {"dp": 4}, "zero2": {"dp": 4}, "fsdp": {"fsdp": 4}, "hsdp": {"dp": 2, "fsdp": 2},
          "tp": {"dp": 2, "tp": 2}, "tp_sp": {"tp": 4}, "fsdp_tp": {"fsdp": 2, "tp": 2},
          "fsdp_tp_sp": {"fsdp": 2, "tp": 2}, "single": {"dp": 4},
          # expert parallel: a dense model's batch split over ep as over a data axis
          "fsdp_ep": {"fsdp": 2, "ep": 2}, "fsdp_tp_ep": {"tp": 2, "ep": 2},
          # context parallel: the sequence split over cp, attention over cp (docs/cp.md)
          "fsdp_cp": {"fsdp": 2, "cp": 2}, "fsdp_tp_cp": {"tp": 2, "cp": 2},
          # pipelines (layers: pp), 2 micro-batches a step (train.grad_accum): meshlm/runtime/pipeline/
          "pp": {"dp": 2, "pp": 2}, "fsdp_pp": {"fsdp": 2, "pp": 2}, "fsdp_tp_pp": {"tp": 2, "pp": 2},
          "fsdp_ep_pp": {"ep": 2, "pp": 2}, "fsdp_cp_pp": {"cp": 2, "pp": 2}}
TINY = {"_target_": "mymodels.TinyLM", "width": 32, "depth": 2, "heads": 4, "mlp": 64}


def _cfg(layout: str, mesh: dict, model: dict = TINY, data: dict | None = None) -> RunConfig:
    t = {"steps": STEPS, "batch_size": 8, "seq_len": 16, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 1,
         "val_every": 0, "val_batches": 1, "progress": False, "count_comm": False, "pg_timeout_s": 60,
         "grad_accum": 2}
    return from_dict({"model": model, "layout": {"name": layout}, "mesh": mesh, "train": t, "data": data or {}})


def _run(cfg: RunConfig, run_dir: str) -> dict:
    from meshlm.app.train import run

    summary = run(cfg, run_dir)
    dist.barrier()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows], "model": summary["model"]}


def test_every_shipped_layout_has_a_mesh_here():
    """Scoped layouts name submodules of a vision-language model (tests/dist/test_vlm.py)."""
    assert sorted(MESHES) == sorted(n for n in shipped_layouts() if not load_layout(n).scopes)


@pytest.fixture(scope="module")
def reference(pool4, tmp_path_factory):
    return pool4.run(_run, _cfg("single", MESHES["single"]), str(tmp_path_factory.mktemp("single")))[0]


@pytest.mark.parametrize("layout", sorted(set(MESHES) - {"single"}))
def test_user_model_trains_under_every_layout(pool4, reference, tmp_path, layout):
    got = pool4.run(_run, _cfg(layout, MESHES[layout]), str(tmp_path))[0]
    loss, ref = got["loss"], reference["loss"]
    assert got["model"] == "TinyLM" and len(loss) == STEPS
    assert abs(loss[0] - ref[0]) <= tol.LOSS_RTOL * ref[0], (loss, ref)
    assert max(abs(a - b) / b for a, b in zip(loss, ref)) <= tol.INVARIANCE_RTOL, (loss, ref)
    assert loss[-1] < loss[0], loss


@pytest.mark.parametrize("model,words", [
    ({**TINY, "_target_": "mymodels.LogitsOnly"}, ["LogitsOnly", "returned a tensor of shape", "scalar loss"]),
    ({"_target_": "mymodels.plain.HugeLM"}, ["too large to build whole on the host", "init_weights(generator)"]),
    ({"_target_": "mymodels.Unannotated"}, ["scale"]),
    ({"_target_": "mymodels.not_a_model"}, ["mymodels.not_a_model returned a Tensor", "torch.nn.Module"]),
], ids=["forward_returns_logits", "too_large_without_init_weights", "unannotated", "not_a_module"])
def test_contract_breaks_stop_the_run_naming_them(pool4, tmp_path, model, words):
    with pytest.raises(WorkerError) as e:
        pool4.run(_run, _cfg("fsdp", {"fsdp": 4}, model), str(tmp_path))
    assert all(w in str(e.value) for w in words), str(e.value)[-2000:]


def test_one_module_in_two_blocks_trains_as_one_weight_and_stops_a_pipeline(pool4, reference, tmp_path):
    """NOTE [ties] in meshlm/core/ties.py: the same Linear as ``blocks.0.up`` and ``blocks.1.up``
    trains under fsdp (the loss falls); pipeline stages would hold two copies of it, so a
    pp layout stops with the error that names both paths (it used to fail inside the
    schedule with a raw stage error, or hang in it)."""
    shared = {**TINY, "_target_": "mymodels.SharedUp"}
    shared.pop("depth"), shared.pop("heads"), shared.pop("mlp")
    got = pool4.run(_run, _cfg("fsdp", MESHES["fsdp"], shared), str(tmp_path / "fsdp"))[0]
    assert got["loss"][-1] < got["loss"][0], got
    with pytest.raises(WorkerError) as e:
        pool4.run(_run, _cfg("pp", MESHES["pp"], shared), str(tmp_path / "pp"))
    msg = str(e.value)
    assert "module `blocks.0.up` is also registered as `blocks.1.up`" in msg and "pipeline stages" in msg, msg[-2000:]


def test_token_ids_beyond_the_model_vocab_stop_the_run(pool4, tmp_path):
    import numpy as np

    for split in ("train", "val"):
        np.arange(400, dtype=np.uint16).repeat(2).tofile(tmp_path / f"{split}.bin")  # ids up to 399
    with pytest.raises(WorkerError) as e:
        pool4.run(_run, _cfg("ddp", {"dp": 4}, data={"format": "tokens", "path": str(tmp_path)}), str(tmp_path))
    assert "400 ids" in str(e.value) and "vocabulary of 256" in str(e.value) and "model.vocab=400" in str(e.value)
    got = pool4.run(_run, _cfg("ddp", {"dp": 4}, {**TINY, "vocab": 400},
                               data={"format": "tokens", "path": str(tmp_path)}), str(tmp_path / "run"))[0]
    assert len(got["loss"]) == STEPS


def _hf_llama(path: Path, vocab: int):
    """A tiny Hugging Face Llama saved in ``path``; weights large enough (init std 0.5) that
    the loss depends on which tokens it sees."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, head_dim=8, initializer_range=0.5,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    m.save_pretrained(str(path), safe_serialization=True)
    return m


def test_fine_tuning_reads_the_data_with_the_model_s_tokenizer(pool4, tmp_path):
    """``model.init_from`` a directory with a tokenizer.json, ``data.tokenizer=auto``: the first
    step's loss is the Hugging Face model's on the first batch of the text tokenized by it."""
    import torch
    import torch.nn.functional as F

    from meshlm.data.text import DataConfig, ShardedLoader, TokenDataset
    from harness.tokenizer import corpus, train_bpe

    d = tmp_path / "hf"
    tok = train_bpe(d)
    m = _hf_llama(d, tok.get_vocab_size())
    text = corpus(tmp_path / "corpus.txt")
    cfg = _cfg("ddp", {"dp": 4}, {"_target_": "meshlm.models.llama_model", "init_from": str(d)},
               data={"path": str(text)})
    got = pool4.run(_run, cfg, str(tmp_path / "run"))[0]
    ds = TokenDataset.from_config(DataConfig(path=str(text)), cfg.train.seq_len, init_from=str(d))
    assert ds.vocab_size == tok.get_vocab_size() > 256
    x, y = ShardedLoader(ds.train, cfg.train.seq_len, cfg.train.batch_size, 0, 1, seed=0).next()
    with torch.no_grad():
        ref = float(F.cross_entropy(m(x).logits.flatten(0, 1), y.flatten()))
    assert got["model"] == str(d)
    assert abs(got["loss"][0] - ref) <= tol.HF_LOSS_RTOL * ref, (got["loss"], ref)
