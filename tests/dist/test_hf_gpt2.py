"""GPT-2 from Hugging Face: a tiny random GPT2LMHeadModel built locally with transformers
(offline), loaded into meshlm.models.GPT2 under every shipped layout (2 ranks, plus a 2x2
fsdp_tp_sp mesh) from every file form (single and sharded safetensors, pytorch_model.bin,
a headless GPT2Model file) with logits equal to transformers'; exported back byte for byte;
bad directories rejected naming the key; and the shipped GPT2 trains as on one device
(harness.check_training, residual dropout and tensor parallel included)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch

from meshlm.layout.rules import is_pipelined, load_layout, shipped_layouts
from harness import WorkerError, dist_pool_fixture
from harness import tolerances as tol
from harness.parity import assert_parity

transformers = pytest.importorskip("transformers")

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

LOGIT_TOL = dict(rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
EMBED, HEADS, VOCAB = 64, 4, 256


def _two_rank_mesh(layout: str) -> str:
    """As tests/dist/test_nn_models.py: over cp if the layout uses cp, else over tp if it uses tp, else over fsdp if it
    stores parameters sharded over fsdp, else over dp."""
    lay = load_layout(layout)
    if "cp" in lay.mesh_axes_used():
        return "cp=2"  # context parallel: the sequence split, attention over cp (docs/cp.md)
    if "tp" in lay.mesh_axes_used():
        return "tp=2"
    return "fsdp=2" if any("fsdp" in v for v in lay.params.values()) else "dp=2"


# pipeline layouts (layers: pp) are tested on pp meshes in tests/dist/test_pipeline.py
# scoped layouts (vlm_fsdp_tp) name submodules of a vision-language model: tests/dist/test_vlm.py
LAYOUTS_2 = [(lay, _two_rank_mesh(lay)) for lay in shipped_layouts()
             if not is_pipelined(load_layout(lay)) and not load_layout(lay).scopes]
FORMS = ("single", "sharded", "bin", "headless")  # the file forms, spread over the layouts


def _hf_model(tie: bool = True):
    from harness.hf_tiny import tiny_gpt2

    return tiny_gpt2(EMBED, HEADS, VOCAB, tie=tie)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_gpt2")
    m = _hf_model()
    dirs = {f: str(d / f) for f in FORMS}
    m.save_pretrained(dirs["single"])
    m.save_pretrained(dirs["sharded"], max_shard_size="100KB")
    assert os.path.isfile(os.path.join(dirs["sharded"], "model.safetensors.index.json"))
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    for form in ("bin", "headless"):
        os.makedirs(dirs[form])
        shutil.copy(os.path.join(dirs["single"], "config.json"), dirs[form])
    torch.save(sd, os.path.join(dirs["bin"], "pytorch_model.bin"))
    from safetensors.torch import save_file

    # GPT2Model's names (no "transformer." prefix), with the causal-mask buffer older files hold
    headless = {k.removeprefix("transformer."): v for k, v in sd.items()}
    headless["h.0.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    save_file(headless, os.path.join(dirs["headless"], "model.safetensors"))
    untied = _hf_model(tie=False)
    untied.save_pretrained(str(d / "untied"))
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ref_untied = m(tokens).logits, untied(tokens).logits
    return {**dirs, "tokens": tokens, "ref": ref, "root": str(d), "untied": str(d / "untied"), "ref_untied": ref_untied}


def _logits(path, layout, mesh_shape, tokens, export_to=None):
    """Logits of the HF directory ``path`` loaded under ``layout``, and the shape of this
    rank's stored block of the first fused QKV weight; exported to ``export_to`` if given."""
    import meshlm
    from meshlm.interop.hf import save_hf

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.load_hf(path, layout, mesh)
    with torch.no_grad():
        out = model(meshlm.shard_batch(tokens, layout, mesh))
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    if export_to:
        save_hf(model, export_to)
    stored = dict(model.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    return out, tuple(stored.to_local().shape)


@pytest.mark.parametrize("layout,mesh", LAYOUTS_2, ids=[f"{lay}-{m}" for lay, m in LAYOUTS_2])
def test_logits_match_transformers(pool2, hf, layout, mesh):
    form = FORMS[[lay for lay, _m in LAYOUTS_2].index(layout) % len(FORMS)]
    got = pool2.run(_logits, hf[form], layout, mesh, hf["tokens"])
    for logits, qkv in got:
        torch.testing.assert_close(logits, hf["ref"], **LOGIT_TOL)
        if mesh == "tp=2":  # NOTE [fused QKV]: each tp rank holds the q, k, v of its own heads
            assert qkv == (3 * EMBED // 2, EMBED), qkv


def test_untied_head(pool2, hf):
    """tie_word_embeddings=false: lm_head.weight is a parameter of its own (vocab over tp)."""
    assert "lm_head.weight" in _read_all(hf["untied"])
    for logits, _qkv in pool2.run(_logits, hf["untied"], "tp", "tp=2", hf["tokens"]):
        torch.testing.assert_close(logits, hf["ref_untied"], **LOGIT_TOL)


def _read_all(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_logits_and_export_2d(pool4, hf):
    """On a 2x2 mesh (heads over tp, embed over fsdp) from the sharded file form: the logits,
    and export moves bytes only: the tensors HF saved, exactly, which transformers loads to
    the original logits, exactly."""
    out = os.path.join(hf["root"], "export_2d")
    for logits, qkv in pool4.run(_logits, hf["sharded"], "fsdp_tp_sp", "fsdp=2,tp=2", hf["tokens"], out):
        torch.testing.assert_close(logits, hf["ref"], **LOGIT_TOL)
        assert qkv == (3 * EMBED // 2, EMBED // 2), qkv  # heads over tp, embed over fsdp
    want, got = _read_all(hf["single"]), _read_all(out)
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    m = transformers.GPT2LMHeadModel.from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(m(hf["tokens"]).logits, hf["ref"], rtol=0, atol=0)


def _convert_both_ways(hf_dir, ckpt_root, out):
    from meshlm.train.convert import convert_main

    assert convert_main([hf_dir, ckpt_root]) == 0  # HF -> meshlm checkpoint (fsdp=2)
    torch._dynamo.reset()
    return convert_main([ckpt_root, out, "--layout", "tp", "--mesh", "tp=2"])


def test_convert_round_trip(pool2, hf):
    """`meshlm convert` both ways: the checkpoint names its class (GPT2) and config, from
    which the export rebuilds the model under another layout; the tensors come back exact."""
    ck, out = os.path.join(hf["root"], "ckpt"), os.path.join(hf["root"], "converted")
    assert pool2.run(_convert_both_ways, hf["bin"], ck, out) == [0, 0]
    want, got = _read_all(hf["single"]), _read_all(out)
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def _load_error(path, layout="fsdp", mesh_shape="fsdp=2"):
    import meshlm

    meshlm.load_hf(path, layout, meshlm.make_mesh(mesh_shape))


def _variant(hf, tmp_path, name, config=None, tensors=None):
    """A copy of the single-file directory with ``config`` keys replaced and ``tensors``
    edited (a function of the state dict)."""
    from safetensors.torch import save_file

    d = tmp_path / name
    d.mkdir()
    cfg = json.load(open(os.path.join(hf["single"], "config.json")))
    json.dump({**cfg, **(config or {})}, open(d / "config.json", "w"))
    sd = _read_all(hf["single"])
    save_file(tensors(sd) if tensors else sd, str(d / "model.safetensors"))
    return str(d)


BAD_FILES = [
    # (name, config.json changes, tensor edit, what the error names)
    ("extra_tensor", None, lambda sd: {**sd, "transformer.h.0.attn.c_attn.lora_A": torch.zeros(2)},
     "'transformer.h.0.attn.c_attn.lora_A'"),
    ("fewer_layers", {"n_layer": 1}, None, "'transformer.h.1."),
    ("missing_tensor", None, lambda sd: {k: v for k, v in sd.items() if k != "transformer.ln_f.bias"},
     "'transformer.ln_f.bias'"),
    ("wrong_positions", {"n_positions": 32}, None, "'transformer.wpe.weight' has shape (64, 64)"),
    ("relu", {"activation_function": "relu"}, None, "activation_function='relu'"),
    ("layer_scaled", {"scale_attn_by_inverse_layer_idx": True}, None, "scale_attn_by_inverse_layer_idx=True"),
    ("bad_heads", {"n_head": 3}, None, "model.embed=64 is not divisible by model.heads=3"),
    ("bert", {"model_type": "bert"}, None, "model_type='bert'"),
]


@pytest.mark.parametrize("name,config,tensors,names", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_hf_gpt2_dir(pool2, hf, tmp_path, name, config, tensors, names):
    path = _variant(hf, tmp_path, name, config, tensors)
    with pytest.raises(WorkerError) as e:
        pool2.run(_load_error, path)
    msg = str(e.value)
    assert ("CheckpointError" in msg or "ConfigError" in msg) and names in msg, msg


def test_export_refuses_a_gpt2_without_biases(tmp_path):
    from meshlm.core.errors import ConfigError
    from meshlm.interop.hf import save_hf
    from meshlm.models import gpt2_model

    with pytest.raises(ConfigError, match="model.bias=false"):
        save_hf(gpt2_model(bias=False), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@dataclass(frozen=True)
class GPT2Build:
    """``build`` for check_training: the shipped GPT2 of conf/model/gpt2_tiny.yaml's shape."""

    dropout: float = 0.0

    def __call__(self, device: str, seed: int):
        from meshlm.models import gpt2_config
        from meshlm.models.gpt2 import GPT2

        return GPT2(gpt2_config("gpt2_tiny", dropout=self.dropout), device=device, seed=seed)


_ok = assert_parity


@pytest.mark.parametrize("layout,mesh,dropout,optims", [("zero2", "dp=2", 0.0, ("sgd",)),
                                                        ("tp_sp", "tp=2", 0.1, ("sgd", "adamw"))])
def test_gpt2_trains_as_on_one_device(pool2, layout, mesh, dropout, optims):
    from harness.parity import TokenBatches, check_training

    batches = TokenBatches(vocab=VOCAB, batch=8, seq=16)
    _ok(pool2.run(check_training, layout, mesh, build=GPT2Build(dropout), batches=batches, optims=optims))
