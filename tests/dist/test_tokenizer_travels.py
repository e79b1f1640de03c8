"""A run's tokenizer travels (NOTE [run tokenizer] in meshlm/train/checkpoint/assets.py): a
fine-tune of a Hugging Face Llama with its own BPE tokenizer (both made locally) records the
tokenizer, generation config and source config in its run directory and each checkpoint;
``meshlm generate`` from the checkpoint decodes with that tokenizer by default (not UTF-8
bytes, which made a fine-tune's text unreadable); ``meshlm convert`` back to Hugging Face writes the tokenizer, a
``generation_config.json`` and a ``config.json`` that keeps the source's special-token ids
and ``max_position_embeddings`` (NOTE [faithful config]), which transformers loads and
continues the prompt with exactly the text meshlm generated."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli_here import cli_here

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPT, NEW = "the quick brown", 8


_cli = cli_here


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from harness.hf_tiny import tiny_llama
    from harness.tokenizer import corpus, train_bpe

    tmp = tmp_path_factory.mktemp("travel")
    src = tmp / "hf"
    train_bpe(src, vocab=300)
    m = tiny_llama(vocab=300)
    m.config.bos_token_id, m.config.eos_token_id, m.config.max_position_embeddings = 7, 0, 128
    m.generation_config.bos_token_id, m.generation_config.eos_token_id = 7, 0
    m.save_pretrained(src, safe_serialization=True)
    data = corpus(tmp / "corpus.txt")
    r = _cli("train", f"model.init_from={src}", f"data.path={data}", "layout=single", "mesh=cpu1", "train.steps=2",
             "train.batch_size=4", "train.seq_len=32", "train.val_every=0", "train.val_batches=1",
             "train.progress=false", f"checkpoint.dir={tmp / 'ck'}", f"hydra.run.dir={tmp / 'run'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, src


def test_run_and_checkpoint_record_the_tokenizer(trained):
    tmp, src = trained
    want = (src / "tokenizer.json").read_bytes()
    for d in (tmp / "run", tmp / "ck" / "step_00000002"):
        assert (d / "tokenizer.json").read_bytes() == want, d
        assert json.loads((d / "hf_config.json").read_text())["eos_token_id"] == 0
        assert (d / "generation_config.json").is_file()
    meta = json.loads((tmp / "ck" / "step_00000002" / "meta.json").read_text())
    assert "tokenizer.json" in meta["files"]  # CRC-checked like the tensors


def test_generate_and_convert_use_it(trained, tmp_path):
    tmp, src = trained
    ck = tmp / "ck"
    gen = _cli("generate", ck, "--prompt", PROMPT, "--max-new-tokens", NEW)
    assert gen.returncode == 0, gen.stderr[-3000:]
    text = gen.stdout.rstrip("\n")
    assert text.startswith(PROMPT), text
    out = tmp_path / "hf_out"
    conv = _cli("convert", ck, out)
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    cfg, source = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "max_position_embeddings", "vocab_size", "hidden_size"):
        assert cfg[key] == source[key], key
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    # transformers reads the export back and continues the prompt as meshlm did
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    new = res[0, ids.shape[1] :].tolist()
    if 0 in new:
        new = new[: new.index(0)]
    assert text == PROMPT + tok.decode(new)
