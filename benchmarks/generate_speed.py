"""Generation speed on one CPU process: meshlm against transformers' `generate`, same model.

    python benchmarks/generate_speed.py [--embed 512] [--layers 8] [--vocab 8192] [--prompt 64]
                                        [--new 64] [--repeats 3] [--out benchmarks/results/generate]

A random Hugging Face Llama (grouped-query attention, untied head; made locally, no
download) is saved and loaded into meshlm (`meshlm.interop.hf.load.load_hf_local`).  In one process,
with the same threads, each side runs greedy generation of `--new` tokens after a prompt of
`--prompt` tokens at batch 1 and 8, best of `--repeats`:

- prefill tokens/s: one forward over the prompts filling the KV cache (transformers:
  `model(ids, use_cache=True)`, meshlm: the same through `meshlm.infer.KVCache`);
- decode tokens/s: batch x (new - 1) tokens over t(generate `new` tokens) - t(generate 1),
  so the prefill and the set-up cancel, for both sides alike;

for transformers, meshlm eager, meshlm with the decode step compiled by inductor
(`generate(..., compile="inductor", freeze=False)`), and compiled with the weights frozen into
it (`compile="inductor"`, NOTE [frozen decode] in meshlm/infer/compiled.py); each compiled
before timing, in a warm-up of the same shapes.  Both sides must produce the same tokens (checked: the script fails otherwise),
so the ratio compares the same work.  The end-of-sequence token is disabled on both sides.

Also recorded: each compiled side's warm-up (its first call, compile and autotuning
included) and the resident memory it added (the frozen side holds a copy of the weights).

Writes <out>/generate_speed_e<embed>_l<layers>_n<new>.json and .md.  Figures are for this machine
only.  Run it at two sizes: where a decode step's weights take most of its time (the
default, 34M parameters), the ratio is the overhead each side adds around the same matmuls;
with a small model (`--embed 256 --layers 4 --vocab 256`, llama_small's shape) that overhead
is most of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch


def _hf_model(a):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.embed,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=3 * a.embed,
        head_dim=a.embed // 8,
        max_position_embeddings=a.prompt + a.new,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    m.generation_config.eos_token_id = None
    return m


def _rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _best(fn, repeats):
    out, best = None, float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/generate")
    a = p.parse_args()

    from meshlm.infer import KVCache, generate
    from meshlm.interop.hf.load import load_hf_local

    hf = _hf_model(a)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        ours = load_hf_local(d)
    params = sum(t.numel() for t in hf.parameters())
    rows = []
    for b in (1, 8):
        ids = torch.randint(0, a.vocab, (b, a.prompt), generator=torch.Generator().manual_seed(b))
        prompts = ids.tolist()
        ones = torch.ones_like(ids)

        def hf_gen(n):
            return hf.generate(ids, attention_mask=ones, max_new_tokens=n, do_sample=False, pad_token_id=0)[
                :, a.prompt :
            ].tolist()

        def ours_gen(n, compile=None, freeze=None):
            return generate(ours, prompts, max_new_tokens=n, compile=compile, freeze=freeze)

        def hf_prefill():
            with torch.no_grad():
                return hf(ids, attention_mask=ones, use_cache=True).logits

        def ours_prefill():
            cache = KVCache(b, a.prompt)
            with torch.no_grad():
                cache.begin(torch.ones(b, a.prompt, dtype=torch.bool))
                out = ours(ids, cache=cache)
                cache.end()
            return out

        warm = {}  # compile (and warm) the decode steps of these shapes: seconds, resident MiB added
        for name, freeze in (("meshlm_compiled", False), ("meshlm_frozen", None)):
            r0, t0 = _rss_mib(), time.perf_counter()
            ours_gen(a.new, "inductor", freeze)
            warm[name] = {"warmup_s": time.perf_counter() - t0, "rss_added_mib": _rss_mib() - r0}
        res = {"batch": b}
        want = None
        for name, gen, prefill in (
            ("transformers", hf_gen, hf_prefill),
            ("meshlm_eager", ours_gen, ours_prefill),
            ("meshlm_compiled", lambda n: ours_gen(n, "inductor", False), ours_prefill),
            ("meshlm_frozen", lambda n: ours_gen(n, "inductor"), ours_prefill),
        ):
            tp, _ = _best(prefill, a.repeats)
            t1, _ = _best(lambda: gen(1), a.repeats)
            tn, toks = _best(lambda: gen(a.new), a.repeats)
            want = want or toks
            if toks != want:
                raise SystemExit(f"{name} at batch {b} generated other tokens than transformers")
            res[name] = {
                "prefill_tok_s": b * a.prompt / tp,
                "decode_tok_s": b * (a.new - 1) / (tn - t1),
                "generate_s": tn,
            }
        for k in ("meshlm_compiled", "meshlm_frozen"):
            res[k].update(warm[k])
        for k in ("meshlm_eager", "meshlm_compiled", "meshlm_frozen"):
            for m in ("prefill_tok_s", "decode_tok_s"):
                res[k][m.replace("_tok_s", "_ratio")] = res[k][m] / res["transformers"][m]
        rows.append(res)
        print(json.dumps(res))

    import transformers

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"Llama, embed {a.embed}, {a.layers} layers, 8 heads / 4 kv heads, mlp {3 * a.embed}, "
        f"vocab {a.vocab}: {params / 1e6:.1f}M parameters, fp32",
        "prompt": a.prompt,
        "new": a.new,
        "command": "python benchmarks/generate_speed.py "
        + " ".join(f"--{k} {v}" for k, v in vars(a).items() if k != "out"),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"generate_speed_e{a.embed}_l{a.layers}_n{a.new}"
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Generation speed ({meta['date']}; {meta['machine']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']})",
        "",
        f"{meta['model']}; prompt {a.prompt}, {a.new} new tokens, greedy; tokens/s, best of " + str(a.repeats) + ".",
        "",
        f"`{meta['command']}`",
        "",
        "| batch | side | prefill tok/s | decode tok/s | prefill vs transformers | decode vs transformers |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k in ("transformers", "meshlm_eager", "meshlm_compiled", "meshlm_frozen"):
            x = r[k]
            ratio = (f"{x['prefill_ratio']:.2f}x", f"{x['decode_ratio']:.2f}x") if k != "transformers" else ("1", "1")
            lines.append(
                f"| {r['batch']} | {k} | {x['prefill_tok_s']:,.0f} | {x['decode_tok_s']:,.1f} | {ratio[0]} | {ratio[1]} |"
            )
    lines += ["", "Warm-up of each compiled side (the first call: compile and autotune, then the tokens):", ""]
    lines += ["| batch | side | warm-up s | resident MiB added |", "|---|---|---|---|"]
    for r in rows:
        for k in ("meshlm_compiled", "meshlm_frozen"):
            lines.append(f"| {r['batch']} | {k} | {r[k]['warmup_s']:.1f} | {r[k]['rss_added_mib']:,.0f} |")
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
