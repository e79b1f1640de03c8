"""``meshlm serve`` under load: static batching against continuous batching, one run.

    python benchmarks/serve_load.py [--embed 256] [--layers 4] [--max-batch 32]
                                    [--concurrency 1 8 32 64] [--requests 64]
                                    [--out benchmarks/results/serve]

Needs httpx (``pip install httpx``) and the serve extra.  A random Hugging Face Llama
(grouped-query attention; made locally, no download) of 128 token ids served with UTF-8
bytes as tokens, so that every token is one ASCII character and one server-sent event,
is served on 127.0.0.1 by ``meshlm serve --scheduler static`` and then by ``--scheduler
continuous`` (the same ``--max-batch``; one server at a time, so they never share the CPU).
A load generator (asyncio + httpx, at most ``concurrency`` requests in flight, localhost
only) sends ``--requests`` streamed, greedy requests per level, one in four long (256 new
tokens) and the rest short (16), and records each request's time to first token (its
first event), its time per output token ((end - first) / (tokens - 1)) and failures.

Then the issue's three targets on each server:

- a short request (16 tokens) sent while a long one (1,500 tokens) decodes, against its
  latency alone (best of 3): within 2x;
- 32 concurrent short requests: requests/s against the same 32 sent one at a time: >= 4x;
- 64 concurrent clients: no request fails.

And the floor: transformers' ``generate`` on the same prompts, one request at a time, in
this process (requests/s, output tokens/s; TTFT from a 1-token generate, per-token from the
rest).  Writes <out>/serve_load.json and .md.  Figures are for this machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHORT, LONG, HOL_LONG = 16, 256, 1500


def _model_dir(a, d: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=a.embed,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=3 * a.embed,
        head_dim=a.embed // 8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    m.config.eos_token_id = m.generation_config.eos_token_id = None  # every request runs to max_tokens
    m.save_pretrained(d, safe_serialization=True)
    return d


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog every day when the sun is up".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) for _ in range(n)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, d: Path, scheduler: str, max_batch: int):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "meshlm.app.cli", "serve", str(d), "--port", str(self.port)]
        cmd += ["--scheduler", scheduler, "--max-batch", str(max_batch), "--max-prompts", "1"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        import httpx

        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read())
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError("meshlm serve did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


async def _one(client, url: str, prompt: str, new: int) -> dict:
    """One streamed request: its start, first-event and end times, tokens, and whether it failed."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first, tokens, ok = None, 0, True
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "start": t0, "end": time.monotonic(), "tokens": 0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    ok = False
                    continue
                n = len(ev["choices"][0]["text"])
                if n and first is None:
                    first = time.monotonic()
                tokens += n
    except Exception:  # noqa: BLE001 - a failed request is counted, not raised
        ok = False
    end = time.monotonic()
    ok = ok and tokens == new
    return {"ok": ok, "start": t0, "first": first, "end": end, "tokens": tokens}


async def _load(url: str, jobs: list[tuple[str, int]], concurrency: int) -> tuple[list[dict], float]:
    """``jobs`` (prompt, new tokens) with at most ``concurrency`` in flight: the results and the wall time."""
    import httpx

    assert url.startswith("http://127.0.0.1:"), "the load generator sends to localhost only"
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def bounded(p, n):
            async with gate:
                return await _one(client, url, p, n)

        t0 = time.monotonic()
        out = await asyncio.gather(*(bounded(p, n) for p, n in jobs))
        return list(out), time.monotonic() - t0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["first"] is not None and r["tokens"] > 1]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "req_s": len(ok) / wall,
        "tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p99": _pct(ttft, 0.99),
        "tpot_p50": _pct(tpot, 0.5),
        "tpot_p99": _pct(tpot, 0.99),
    }


def _mix(n: int, seed: int) -> list[tuple[str, int]]:
    return [(p, LONG if i % 4 == 3 else SHORT) for i, p in enumerate(_prompts(n, seed))]


def _targets(url: str) -> dict:
    """The issue's three targets against one server."""
    short = [(p, SHORT) for p in _prompts(32, seed=7)]

    def run(jobs, c):
        return asyncio.run(_load(url, jobs, c))

    def once(job):
        r = run([job], 1)[0][0]
        return r["end"] - r["start"]

    alone = min(once(short[0]) for _ in range(3))

    async def during_long():
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            long = asyncio.ensure_future(_one(client, url, "a long story", HOL_LONG))
            await asyncio.sleep(1.0)
            r = await _one(client, url, short[0][0], SHORT)
            long_done = long.done()
            await long
            return r["end"] - r["start"], long_done

    took, long_done = asyncio.run(during_long())
    serial_res, serial_wall = run(short, 1)
    conc_res, conc_wall = run(short, 32)
    many_res, _ = run([(p, SHORT) for p in _prompts(64, seed=9)], 64)
    return {
        "short_alone_s": alone,
        "short_during_long_s": took,
        "long_done_first": long_done,
        "hol_ratio": took / alone,
        "serial_req_s": len(short) / serial_wall,
        "concurrent32_req_s": len(short) / conc_wall,
        "throughput_ratio": serial_wall / conc_wall,
        "failed_at_64": sum(not r["ok"] for r in many_res) + sum(not r["ok"] for r in conc_res + serial_res),
    }


def _floor(d: Path, jobs: list[tuple[str, int]]) -> dict:
    """transformers' generate, one request at a time, on the same prompts."""
    import transformers

    m = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    results, at = [], 0.0
    with torch.no_grad():
        for p, n in jobs:
            ids = torch.tensor([list(p.encode())])
            s = time.monotonic()
            m.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.monotonic() - s  # its time to first token: a 1-token generate
            s = time.monotonic()
            out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            tn = time.monotonic() - s
            results.append(
                {"ok": True, "start": at, "first": at + t1, "end": at + tn, "tokens": out.shape[1] - ids.shape[1]}
            )
            at += tn
    return _summary(results, at)


def _table(rows: list[dict]) -> str:
    head = "| server | concurrency | requests | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | per-token p50 | per-token p99 |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ms = lambda x: f"{1000 * x:.0f} ms" if x == x else "-"  # noqa: E731
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['failed']} | {r['req_s']:.1f} | "
            f"{r['tok_s']:.0f} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | {ms(r['tpot_p50'])} | {ms(r['tpot_p99'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--floor-requests", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results/serve")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, targets = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        d = _model_dir(a, Path(tmp))
        for sched in ("static", "continuous"):
            srv = Server(d, sched, a.max_batch)
            try:
                asyncio.run(_load(srv.url, _mix(4, seed=99), 4))  # warm-up
                for c in a.concurrency:
                    res, wall = asyncio.run(_load(srv.url, _mix(a.requests, seed=c), c))
                    rows.append({"server": sched, "concurrency": c, **_summary(res, wall)})
                    print(rows[-1], flush=True)
                targets[sched] = _targets(srv.url)
                print(sched, targets[sched], flush=True)
            finally:
                srv.stop()
        floor = _floor(d, _mix(a.floor_requests, seed=1))
        rows.append({"server": "transformers generate, one at a time", "concurrency": 1, **floor})
    meta = {
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": f"random Llama, embed {a.embed}, {a.layers} layers, vocab 128, fp32",
        "max_batch": a.max_batch,
    }
    (out / "serve_load.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=1))
    tgt = ["| target | static | continuous |", "|---|---|---|"]
    for key, what in (
        ("hol_ratio", "short request during a long one / alone (<= 2)"),
        ("throughput_ratio", "32 concurrent short / one at a time, req/s (>= 4)"),
        ("failed_at_64", "failed requests at 64 clients (0)"),
    ):
        tgt.append(f"| {what} | {targets['static'][key]:.2f} | {targets['continuous'][key]:.2f} |")
    md = f"{meta}\n\n{_table(rows)}\n\n" + "\n".join(tgt) + "\n"
    (out / "serve_load.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
