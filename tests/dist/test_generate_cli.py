"""`meshlm generate` as a user runs it: a tiny 4-layer GPT-2 with a BPE tokenizer (both made
locally), from its Hugging Face directory and from a meshlm checkpoint converted from it,
on one process and tensor parallel over 2 workers it launches itself: the same text, which
is transformers' greedy continuation; one prompt streams; bad input exits non-zero with the
reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harness import dist_pool_fixture

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPTS = ["the quick brown", "a lazy dog"]
NEW = 10
pool1 = dist_pool_fixture(1, timeout_s=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from harness.hf_tiny import tiny_gpt2
    from harness.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("gpt2")
    tok = train_bpe(d, vocab=300)
    m = tiny_gpt2(vocab=300, layers=4)
    m.save_pretrained(d, safe_serialization=True)
    want = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        new = [t for t in out[0, ids.shape[1] :].tolist() if t != m.config.eos_token_id]
        want.append(p + tok.decode(new))
    return d, want


def _meshlm(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "meshlm.app.cli", "generate", *map(str, args)],
                          capture_output=True, text=True, timeout=240, cwd=cwd)


def _cli(*args) -> tuple[int, str, str]:
    """``meshlm ARGS`` through the command's entry point in this process (one process: a
    process start and torch import saved per run; runs that start the command's own workers
    go through ``_meshlm``, and the exit codes 1 and 2 are checked in processes of their own
    in ``test_bad_input_exits_with_the_reason``): its exit code, stdout and stderr."""
    import contextlib
    import io

    from meshlm.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_text_equals_transformers_single_and_tp2(model_dir):
    d, want = model_dir
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    code, one, err = _cli("generate", d, *prompts, "--max-new-tokens", NEW)
    assert code == 0, err
    assert one.splitlines() == [f"[{i}] {w}" for i, w in enumerate(want)]
    tp = _meshlm(d, *prompts, "--max-new-tokens", NEW, "--layout", "tp", "--mesh", "tp=2")
    assert tp.returncode == 0, tp.stderr
    assert tp.stdout == one
    # `layout=tp mesh=tp2` composes the job these flags do: tests/unit/test_grammar.py (NOTE [one grammar])
    frozen = _meshlm(d, *prompts, "--max-new-tokens", NEW, "--compile", "inductor")  # NOTE [frozen decode]
    assert frozen.returncode == 0, frozen.stderr
    assert frozen.stdout == one and "AUTOTUNE" not in frozen.stderr


def test_from_a_meshlm_checkpoint(model_dir, tmp_path):
    d, want = model_dir
    code, _, err = _cli("convert", d, tmp_path / "ck")
    assert code == 0, err
    code, out, err = _cli("generate", tmp_path / "ck", "--prompt", PROMPTS[0], "--max-new-tokens", NEW,
                               "--tokenizer", d)
    assert code == 0, err
    assert out == want[0] + "\n"


def _streamed(path, prompt, n):
    from meshlm.app.generate import parser, run

    class Writes(list):
        def write(self, s):
            self.append(s)

        def flush(self):
            pass

    out = Writes()
    run(parser().parse_args([str(path), "--prompt", prompt, "--max-new-tokens", str(n)]), out=out)
    return list(out)


def test_one_prompt_streams(pool1, model_dir):
    d, want = model_dir
    writes = pool1.run(_streamed, d, PROMPTS[1], NEW)[0]
    assert "".join(writes) == want[1] + "\n"
    assert writes[0] == PROMPTS[1]
    assert len([w for w in writes if w]) >= 4  # the prompt, then pieces as they were made


def test_bad_input_exits_with_the_reason(model_dir, tmp_path):
    d, _ = model_dir
    r = _meshlm(d, "--prompt", "the " * 40, "--max-new-tokens", 30)
    assert r.returncode == 1 and "exceeds the model's context of 64 tokens" in r.stderr
    r = _meshlm(d, "--prompt", "x", "--temprature", "1")
    assert r.returncode == 2 and "unrecognized arguments: --temprature" in r.stderr
    code, _, err = _cli("generate", d, "--prompt", "x", "--top-p", "0")
    assert code == 1 and "sampling.top_p=0.0 must be in (0, 1]" in err
    code, _, err = _cli("generate", d, "--prompt", "x", "--stop", "the quick brown")
    assert code == 1 and "--stop 'the quick brown' is" in err and "must be one token" in err
    code, _, err = _cli("generate", d, "--prompt", "x", "--tokenizer", "bytes", "--max-new-tokens", 2)
    assert code == 0, err  # 256 byte ids fit the model's 300
    bad = tmp_path / "mismatch"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["n_layer"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = _cli("generate", bad, "--prompt", "x")  # an exception other than meshlm's would raise here
    assert code == 1 and "meshlm generate: error:" in err and "transformer.h.3" in err, err
    code, _, err = _cli("generate", tmp_path / "nowhere", "--prompt", "x")
    assert code == 1 and "no such directory; give a Hugging Face model directory" in err
    code, _, err = _cli("generate", d, "--prompt-file", tmp_path / "none.txt")
    assert code == 1 and "--prompt-file" in err and "no such file" in err
    code, _, err = _cli("generate", d, "--prompt", "x", "--layout", "fsdp", "--mesh", "fsdp=2")
    assert code == 1 and "splits the batch over fsdp=2" in err


def test_memory_limited_placement(model_dir, tmp_path):
    """--max-memory-per-device: the same text with blocks streamed from disk (their files gone
    when the process exits), and over two processes (a stage each); --plan prints the
    placement; too small a limit, or a limit with tensor parallel, refused (these three in
    this process)."""
    d, want = model_dir
    args = ["generate", d, "--prompt", PROMPTS[0], "--max-new-tokens", NEW, "--offload-dir", tmp_path]
    code, out, err = _cli(*args, "--max-memory-per-device", "0.75MiB", "--plan")
    assert code == 0, err
    assert "placement: 1 of 4 blocks resident, 3 streamed from disk" in out
    assert "KV cache" in out and "device total" in out
    r = _meshlm(*args[1:], "--max-memory-per-device", "0.75MiB")  # a process of its own: its exit
    assert r.returncode == 0, r.stderr
    assert r.stdout == want[0] + "\n" and "3 streamed from disk" in r.stderr
    assert not any(tmp_path.rglob("*.bin"))  # the disk tier's files are gone at exit
    code, out, err = _cli(*args, "--max-memory-per-device", "0.1MiB")
    assert code == 1 and "even with every block streamed from disk" in err and "MiB on the device" in err
    code, out, err = _cli(*args, "--max-memory-per-device", "1GiB", "--layout", "tp", "--mesh", "tp=2")
    assert code == 1 and "one stage per process over `pp` (--mesh pp=N)" in err
    r = _meshlm(*args[1:], "--max-memory-per-device", "0.75MiB", "--mesh", "pp=2")  # a stage per process
    assert r.returncode == 0, r.stderr
    assert r.stdout == want[0] + "\n" and "device 1: blocks 2..3" in r.stderr
