"""`meshlm serve` under a real HTTP client (the standard library's): a tiny GPT-2 with a BPE
tokenizer (both made locally) served on one process and tensor parallel over 2 workers;
concurrent requests, batched by the server, each get the text the model generates for its
prompt alone; a streamed request gets the same text in pieces; malformed and over-long
requests get a 4xx with the reason and the server stays up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

PROMPTS = ["the quick brown", "a lazy dog", "the fox", "every day the sun", "a lazy", "the dog and"]
MAX = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from harness.hf_tiny import tiny_gpt2
    from harness.tokenizer import train_bpe
    from meshlm.infer import generate
    from meshlm.interop.hf.load import load_hf_local

    d = tmp_path_factory.mktemp("gpt2")
    tok = train_bpe(d, vocab=300)
    tiny_gpt2(vocab=300, layers=4).save_pretrained(d, safe_serialization=True)
    model = load_hf_local(str(d))
    want = {}
    for p in PROMPTS:  # each prompt alone, greedy, up to the end-of-sequence token (0)
        new = generate(model, [tok.encode(p).ids], max_new_tokens=MAX, stop=[0])[0]
        want[p] = tok.decode([t for t in new if t != 0])
    return d, want


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, d, *args):
        self.port = _port()
        cmd = [sys.executable, "-m", "meshlm.app.cli", "serve", str(d), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("meshlm serve did not come up in 120 s")

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path):
        with urllib.request.urlopen(self.url(path), timeout=30) as r:
            return json.loads(r.read())

    def post(self, body, raw=None):
        """(status, parsed JSON or the raw event-stream text)."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url("/v1/completions"), data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                text = r.read().decode()
                return r.status, (text if r.headers.get_content_type() == "text/event-stream" else json.loads(text))
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir[0], "--max-batch", "8")
    yield s
    s.stop()


def _concurrent(server, prompts):
    out, gate = {}, threading.Barrier(len(prompts))

    def one(p):
        gate.wait()
        out[p] = server.post({"prompt": p, "max_tokens": MAX, "temperature": 0})

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_concurrent_requests_are_batched_and_each_gets_its_own_text(server, model_dir):
    _, want = model_dir
    before = server.get("/health")["steps"]
    got = _concurrent(server, PROMPTS)
    for p in PROMPTS:
        status, body = got[p]
        assert status == 200, body
        assert body["choices"][0]["text"] == want[p]
        assert body["usage"]["completion_tokens"] >= 1
    # batched: fewer iterations than one request after another would take (a forward per token)
    assert server.get("/health")["steps"] - before < sum(body["usage"]["completion_tokens"] for _, body in got.values())


def test_a_list_of_prompts_and_a_stream(server, model_dir):
    _, want = model_dir
    status, body = server.post({"prompt": PROMPTS[:2], "max_tokens": MAX})
    assert status == 200 and [c["text"] for c in body["choices"]] == [want[p] for p in PROMPTS[:2]]
    status, events = server.post({"prompt": PROMPTS[5], "max_tokens": MAX, "stream": True})  # no cut UTF-8
    assert status == 200
    lines = [ln.removeprefix("data: ") for ln in events.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln)["choices"][0] for ln in lines[:-1]]
    assert "".join(c["text"] for c in chunks) == want[PROMPTS[5]]
    assert len(chunks) >= 3 and chunks[-1]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "body,raw,status,says",
    [
        (None, b"{not json", 422, "not JSON"),
        ({"prompt": "x", "temprature": 1.0}, None, 400, "unknown field 'temprature'"),
        ({"prompt": "the " * 40, "max_tokens": 30}, None, 400, "exceeds the context of 64 tokens"),
        ({"prompt": "x", "top_p": 0}, None, 400, "`top_p`=0 must be in (0, 1]"),
        ({"prompt": ""}, None, 400, "`prompt` must be a non-empty string"),
        ({"prompt": "x", "max_tokens": "9"}, None, 400, "`max_tokens`='9'"),
        ({"prompt": "x", "stop": "the quick brown"}, None, 400, "a stop text must be one token"),
    ],
)
def test_bad_requests_get_a_4xx_and_the_server_stays_up(server, model_dir, body, raw, status, says):
    code, out = server.post(body, raw=raw)
    assert code == status and says in out["error"]["message"], out
    ok, again = server.post({"prompt": PROMPTS[0], "max_tokens": MAX})
    assert ok == 200 and again["choices"][0]["text"] == model_dir[1][PROMPTS[0]]


def test_tensor_parallel_server_serves_the_same_text(model_dir):
    d, want = model_dir
    s = Server(d, "--layout", "tp", "--mesh", "tp=2")
    try:
        got = _concurrent(s, PROMPTS[:3])
        assert {p: got[p][1]["choices"][0]["text"] for p in PROMPTS[:3]} == {p: want[p] for p in PROMPTS[:3]}
    finally:
        s.stop()
    assert s.proc.returncode is not None


def test_a_server_under_a_memory_limit_streams_blocks(model_dir, tmp_path):
    """--max-memory-per-device placed for --max-batch rows of --context positions: blocks
    streamed from disk, the same texts; a request beyond the placed context is refused."""
    d, want = model_dir
    args = ["--max-memory-per-device", "1.2MiB", "--max-batch", "4", "--context", "32", "--offload-dir", tmp_path]
    s = Server(d, *map(str, args))
    try:
        got = _concurrent(s, PROMPTS[:4])
        assert {p: got[p][1]["choices"][0]["text"] for p in PROMPTS[:4]} == {p: want[p] for p in PROMPTS[:4]}
        code, out = s.post({"prompt": "the " * 10, "max_tokens": 30})
        assert code == 400 and "exceeds the context of 32 tokens" in out["error"]["message"]
    finally:
        s.stop()
    assert "1 of 4 blocks resident, 3 streamed from disk" in s.proc.stderr.read()


def test_static_scheduler_serves_the_same_text(model_dir):
    """--scheduler static (the earlier engine, kept to compare): the same texts."""
    d, want = model_dir
    s = Server(d, "--scheduler", "static", "--max-batch", "4")
    try:
        got = _concurrent(s, PROMPTS[:4])
        assert {p: got[p][1]["choices"][0]["text"] for p in PROMPTS[:4]} == {p: want[p] for p in PROMPTS[:4]}
        assert s.get("/health")["batches"] >= 1
    finally:
        s.stop()
