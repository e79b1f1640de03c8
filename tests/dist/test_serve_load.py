"""``meshlm serve`` under load (issue 48's measured failures, each a test): a short request sent
while a long one decodes, or batched with long ones, ends in about its time alone (head-of-line
blocking); 40 concurrent requests: the first ends in the time of a batch; a Llama of 128
positions (``max_position_embeddings``) refuses longer requests with a 400; a client that
disconnects mid-stream frees its slot within an iteration; every malformed field is a 400
naming it, never a 500; 64 concurrent clients all get their own text; ``/metrics`` counts
what was served.  Tiny random models made locally, served as a subprocess, queried with the
standard library's HTTP client."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from test_serve import Server

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

SLACK_S = 1.0  # on top of 2x: a shared 2-core machine's scheduling noise, far below what a held request waits


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """A tiny GPT-2 of 4096 positions that never stops early (no end-of-sequence token)."""
    from harness.hf_tiny import tiny_gpt2
    from harness.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("gpt2_long")
    train_bpe(d, vocab=300)
    m = tiny_gpt2(vocab=300, layers=4, positions=4096)
    m.config.eos_token_id = m.generation_config.eos_token_id = None
    m.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def server(long_dir):
    s = Server(long_dir, "--max-batch", "8")
    yield s
    s.stop()


def _timed(server, body):
    t0 = time.monotonic()
    status, out = server.post(body)
    assert status == 200, out
    return time.monotonic() - t0, out


def _alone(server, body, n=3):
    return min(_timed(server, body)[0] for _ in range(n))


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args)), daemon=True)
    t.start()
    return t, box


SHORT = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 0.7, "seed": 1}


def test_a_short_request_is_not_held_by_a_long_one(server):
    """Measured on the static engine: an 8-token request sent after one of 1,500 tokens
    (other sampling options) took the long one's time.  Now: within 2x its time alone."""
    alone = _alone(server, SHORT)
    long, box = _in_thread(_timed, server, {"prompt": "a lazy dog", "max_tokens": 3000, "temperature": 0})
    time.sleep(1.0)  # the long request is decoding
    took, _ = _timed(server, SHORT)
    assert took < 2 * alone + SLACK_S, (took, alone)
    assert long.is_alive(), "the long request ended first: it was not long enough to show anything"
    long.join(300)


def test_a_request_takes_its_own_time_not_its_batchs(server):
    """A 16-token request sent together with 7 of 300 tokens (the same sampling options, so
    the static engine batched them and ended it with the longest): within 2x its time alone."""
    body = {"prompt": "the fox", "max_tokens": 16, "temperature": 0}
    alone = _alone(server, body)
    gate = threading.Barrier(8)
    times = {}

    def one(i):
        gate.wait()
        times[i] = _timed(server, body if i == 0 else {**body, "max_tokens": 300})[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert times[0] < 2 * alone + SLACK_S, (times[0], alone)
    assert times[0] < min(times[i] for i in range(1, 8))


def test_forty_concurrent_requests_the_first_ends_in_a_batchs_time(server):
    """Measured: 40 concurrent 16-token requests, the fastest ended after 17.9 s where a
    batch of 8 alone took 3.0 s (tokens read by executor threads held by queued requests)."""
    body = {"prompt": "every day the sun", "max_tokens": 16, "temperature": 0}

    def burst(n):
        gate, times = threading.Barrier(n), []

        def one():
            gate.wait()
            times.append(_timed(server, body)[0])

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(times) == n
        return times

    batch = min(max(burst(8)) for _ in range(2))  # a batch of 8 alone
    times = burst(40)
    assert min(times) < 2 * batch + SLACK_S, (min(times), batch)


def test_a_disconnected_stream_leaves_the_batch(long_dir):
    """Measured: a client that went away mid-stream left its request decoding to max_tokens.
    One slot (--max-batch 1): after the disconnect (mid-stream, or while waiting for a whole
    response) the next request is served in about its time alone, and /metrics counts each
    cancelled request as 499 with the batch empty."""
    s = Server(long_dir, "--max-batch", "1")
    try:
        body = {"prompt": "the fox", "max_tokens": 8, "temperature": 0}
        alone = _alone(s, body)
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request(
            "POST", "/v1/completions", json.dumps({"prompt": "a lazy dog", "max_tokens": 4000, "stream": True})
        )
        r = conn.getresponse()
        assert r.status == 200
        r.fp.readline()  # the first event: it is decoding
        conn.sock.shutdown(2)
        conn.close()
        took, _ = _timed(s, body)
        assert took < 2 * alone + SLACK_S, (took, alone)
        # a client that waits for a whole response, and goes away after half a second
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "a lazy dog", "max_tokens": 4000}))
        time.sleep(0.5)
        conn.sock.shutdown(2)
        conn.close()
        took, _ = _timed(s, body)
        assert took < 2 * alone + SLACK_S, (took, alone)
        text = _metrics(s)
        assert text["meshlm_requests_total"][(("status", "499"),)] == 2
        assert text["meshlm_batch_occupancy"][()] == 0
    finally:
        s.stop()


def _metrics(server) -> dict:
    """/metrics parsed: {sample name: {labels: value}}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as r:
        assert r.headers.get_content_type() == "text/plain"
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, {})[tuple(sorted(smp.labels.items()))] = smp.value
    return out


LONE = b'{"prompt": "the \\ud800 fox", "max_tokens": 4}'


@pytest.mark.parametrize(
    "body,raw,says",
    [
        ({"prompt": "x", "seed": 1.5}, None, "`seed`=1.5 must be a whole number"),
        ({"prompt": "x", "seed": 2**70}, None, f"`seed`={2**70} must be a whole number"),
        ({"prompt": "x", "seed": -1}, None, "`seed`=-1 must be a whole number"),
        (None, LONE, "`prompt` holds a lone surrogate (U+D800"),
        ({"prompt": "x", "stop": "\ud800"}, None, "`stop` holds a lone surrogate"),
        (None, b'{"prompt": "x", "temperature": Infinity}', "`temperature`=inf must be a finite number"),
        (None, b'{"prompt": "x", "top_p": NaN}', "`top_p`=nan must be a finite number"),
        ({"prompt": "x", "stream": "yes"}, None, "`stream`='yes' must be true or false"),
        ({"prompt": ["x"] * 64}, None, "a list of 64 prompts; this server takes at most 16"),
        ({"prompt": "x", "max_tokens": 10**12}, None, "`max_tokens`=1000000000000 must be a whole number"),
        ({"prompt": "x", "max_tokens": 5000}, None, "(--max-tokens)"),
        ({"prompt": "x", "top_k": 2.5}, None, "`top_k`=2.5 must be a whole number"),
        ({"prompt": "x", "temperature": "hot"}, None, "`temperature`='hot' must be a finite number"),
        ({"prompt": "x", "user": 3}, None, "`user` must be a string"),
    ],
)
def test_every_bad_field_is_a_400_naming_it(server, body, raw, says):
    code, out = server.post(body, raw=raw)
    assert code == 400 and says in out["error"]["message"], (code, out)


def test_sixty_four_concurrent_clients_all_get_their_text(server):
    """64 clients at once (8 slots): every one a 200 with the text its prompt gets alone."""
    prompts = [f"the {w} {i}" for i, w in enumerate(["fox", "dog", "sun", "day"] * 16)]
    want = {}
    for p in prompts[:4]:
        want[p] = server.post({"prompt": p, "max_tokens": 8})[1]["choices"][0]["text"]
    gate, got = threading.Barrier(64), {}

    def one(p):
        gate.wait()
        got[p] = server.post({"prompt": p, "max_tokens": 8})

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(code for code, _ in got.values()) == [200] * 64
    assert {p: got[p][1]["choices"][0]["text"] for p in prompts[:4]} == want


def test_metrics_count_what_was_served(long_dir):
    s = Server(long_dir, "--max-batch", "4")
    try:
        outs = [s.post({"prompt": p, "max_tokens": n}) for p, n in (("the fox", 5), ("a lazy dog", 7))]
        s.post({"prompt": "x", "seed": 1.5})
        m = _metrics(s)
        assert m["meshlm_requests_total"] == {(("status", "200"),): 2, (("status", "400"),): 1}
        assert m["meshlm_output_tokens_total"][()] == sum(o["usage"]["completion_tokens"] for _, o in outs) == 12
        assert m["meshlm_prompt_tokens_total"][()] == sum(o["usage"]["prompt_tokens"] for _, o in outs)
        assert m["meshlm_time_to_first_token_seconds_count"][()] == 2
        assert m["meshlm_time_per_output_token_seconds_count"][()] == 12 - 2
        assert m["meshlm_batch_slots"][()] == 4 and m["meshlm_queue_depth"][()] == 0
    finally:
        s.stop()


@pytest.fixture(scope="module")
def rope_dir(tmp_path_factory):
    """A tiny Hugging Face Llama of max_position_embeddings=128, byte tokens."""
    from harness.hf_tiny import tiny_llama

    d = tmp_path_factory.mktemp("llama128")
    m = tiny_llama()
    assert m.config.max_position_embeddings == 128
    m.save_pretrained(d, safe_serialization=True)
    return d


def test_a_rope_models_context_is_its_limit(rope_dir):
    """Measured: a 500-token prompt on a model of 128 positions got a 200 and text;
    max_tokens=100000 was accepted and decoded for minutes; 10**12 was a 500."""
    s = Server(rope_dir, "--max-batch", "2")
    try:
        for body, says in (
            ({"prompt": "a" * 500, "max_tokens": 4}, "exceeds the context of 128 tokens"),
            ({"prompt": "abc", "max_tokens": 100000}, "`max_tokens`=100000 must be a whole number in [1, 127]"),
            ({"prompt": "abc", "max_tokens": 10**12}, "`max_tokens`=1000000000000"),
            ({"prompt": "a" * 100, "max_tokens": 29}, "= 129 exceeds the context of 128 tokens"),
        ):
            code, out = s.post(body)
            assert code == 400 and says in out["error"]["message"], (code, out)
        code, out = s.post({"prompt": "a" * 100, "max_tokens": 28})
        assert code == 200 and out["usage"]["completion_tokens"] >= 1
    finally:
        s.stop()


def test_context_beyond_the_models_is_refused(rope_dir):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "meshlm.app.cli", "serve", str(rope_dir), "--context", "4096", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr[-2000:]
    assert "--context 4096 exceeds the model's context of 128 positions (config.json max_position_embeddings)" in (
        p.stderr
    )
