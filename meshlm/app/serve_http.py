"""The HTTP side of ``meshlm serve``: OpenAI's completions API (FastAPI, the ``serve`` extra)
in front of a scheduler (NOTE [continuous batching] in meshlm/infer/scheduler.py, or the
static engine of NOTE [static batching]), and ``/metrics`` in Prometheus' text format.

NOTE [serving requests]
    Every field of a request is checked before anything reaches the scheduler, and a bad
    one is a 400 naming it (a body that is not JSON: 422); the server stays up and nothing
    is a 500 unless the model itself failed.  The limits: a prompt plus ``max_tokens``
    within the context the server was started for, ``max_tokens`` at most ``--max-tokens``,
    at most ``--max-prompts`` prompts, text that is valid Unicode (no lone surrogate),
    finite numbers, whole ones where a count or a seed is meant.

    Tokens come back from the scheduler's thread through the event loop
    (``call_soon_threadsafe``): no thread is held per request, so a request waiting for a
    slot costs nothing and a finished one is read at once.  A task per HTTP request watches
    for its client's disconnect and cancels its requests, which leave the batch at the
    scheduler's next iteration.  A request past ``--request-timeout`` is a 504 (in a
    stream, an error event); one the server stopped before it was done, a 503.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations
# (``Request``, imported inside ``app``) at run time.
import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from meshlm.core.errors import ConfigError
from meshlm.infer.generate import stop_id
from meshlm.infer.sample import Sampling
from meshlm.infer.scheduler import Cancelled, Request, Stopped, TimedOut

KNOWN = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "user")
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 <= seed < 2**64


@dataclass(frozen=True)
class Limits:
    """What one request may ask (NOTE [serving requests])."""

    context: int
    max_tokens: int
    max_prompts: int
    timeout: Optional[float] = None


def _text(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{what} must be a string, not {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{what} holds a lone surrogate (U+{ord(v[e.start]):04X} at character {e.start}): not valid Unicode "
            "text; send UTF-8 text (a JSON \\ud83d escape must be followed by its low surrogate)"
        ) from None
    return v


def _whole(body: dict, key: str, default: int, lo: int, hi: int, why: str = "") -> int:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)  # 16.0 is 16, as JSON does not tell them apart
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ConfigError(f"`{key}`={v!r} must be a whole number in [{lo}, {hi - 1}]{why}")
    return v


def _number(body: dict, key: str) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ConfigError(f"`{key}`={v!r} must be a finite number")
    return float(v)


def parse(body: Any, tok: Any, limits: Limits, default_stop: tuple[int, ...] = ()) -> tuple[list[Request], bool]:
    """The requests of a completions body (one per prompt) and whether it is streamed; a
    ConfigError names the field that is wrong (NOTE [serving requests])."""
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(KNOWN))
    if unknown:
        raise ConfigError(f"unknown field {unknown[0]!r}; this server takes: {', '.join(sorted(KNOWN))}")
    for key in ("model", "user"):
        if body.get(key) is not None:
            _text(body[key], f"`{key}`")
    prompts = body.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError("`prompt` must be a non-empty string or a list of them")
    if len(prompts) > limits.max_prompts:
        raise ConfigError(
            f"`prompt` is a list of {len(prompts)} prompts; this server takes at most {limits.max_prompts} a request "
            "(--max-prompts): send them in several requests"
        )
    for i, p in enumerate(prompts):
        _text(p, "`prompt`" if len(prompts) == 1 else f"`prompt`[{i}]")
    max_tokens = _whole(body, "max_tokens", min(16, limits.max_tokens), 1, limits.max_tokens + 1, " (--max-tokens)")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ConfigError(f"`stream`={stream!r} must be true or false")
    opts: dict[str, Any] = {}
    t, p = _number(body, "temperature"), _number(body, "top_p")
    if t is not None:
        if t < 0:
            raise ConfigError(f"`temperature`={body['temperature']!r} must be >= 0 (0 is greedy)")
        opts["temperature"] = t
    if p is not None:
        if not 0 < p <= 1:
            raise ConfigError(f"`top_p`={body['top_p']!r} must be in (0, 1] (1 keeps every token)")
        opts["top_p"] = p
    if body.get("top_k") is not None:
        opts["top_k"] = _whole(body, "top_k", 0, 0, 2**31)
    if body.get("seed") is not None:
        opts["seed"] = _whole(body, "seed", 0, 0, SEED_LIMIT)
    sampling = Sampling.from_dict(opts)
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else (stops or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ConfigError("`stop` must be a string or a list of strings")
    stop_ids = tuple(default_stop) + tuple(stop_id(tok, _text(s, "`stop`"), "`stop`") for s in stops)
    reqs = []
    for row, p in enumerate(prompts):
        ids = tok.encode(p).tolist()
        if not ids:
            raise ConfigError("`prompt` is no token under this tokenizer")
        if len(ids) + max_tokens > limits.context:
            raise ConfigError(
                f"`prompt` of {len(ids)} tokens + `max_tokens`={max_tokens} = {len(ids) + max_tokens} exceeds the "
                f"context of {limits.context} tokens this server takes: shorten the prompt or ask for fewer tokens"
            )
        reqs.append(Request(ids, max_tokens, sampling, stop_ids, timeout=limits.timeout, row=row))
    return reqs, stream


class _LoopQueue:
    """Where the scheduler's thread puts a request's tokens for its handler on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.q = loop, asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits for it
            pass

    async def get(self) -> Any:
        return await self.q.get()


_END = object()


def _status(e: BaseException) -> int:
    """The HTTP status of a request the scheduler ended with ``e``."""
    if isinstance(e, TimedOut):
        return 504
    if isinstance(e, Stopped):
        return 503
    if isinstance(e, Cancelled):
        return 499  # the client closed the connection (nginx's code: nobody reads it)
    return 500


class Metrics:
    """``/metrics`` (prometheus-client, a registry of this server's own): requests by status,
    tokens in and out, the queue and the batch, time to first token and per output token."""

    def __init__(self, engine: Any, max_batch: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("meshlm_requests", "Completion requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("meshlm_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.output_tokens = Counter("meshlm_output_tokens", "Tokens generated", registry=r)
        Gauge("meshlm_queue_depth", "Requests waiting for a batch slot", registry=r).set_function(
            lambda: engine.waiting
        )
        Gauge("meshlm_batch_occupancy", "Requests in the batch being decoded", registry=r).set_function(
            lambda: engine.running
        )
        Gauge("meshlm_batch_slots", "Requests decoded together at most (--max-batch)", registry=r).set(max_batch)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
        self.ttft = Histogram(
            "meshlm_time_to_first_token_seconds", "From a request's arrival to its first token", buckets=buckets,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "meshlm_time_per_output_token_seconds", "Between a request's consecutive tokens",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0), registry=r,
        )  # fmt: skip

    def attach(self, req: Request, q: _LoopQueue) -> None:
        """``req``'s tokens and end go to ``q``, observed on the way (on the scheduler's thread)."""
        last = [0.0]

        def on_token(t: int) -> None:
            now = time.monotonic()
            if last[0]:
                self.tpot.observe(now - last[0])
            else:
                self.ttft.observe(now - req.submitted)
            last[0] = now
            q.put(t)

        def on_end(error: Optional[BaseException]) -> None:
            self.prompt_tokens.inc(len(req.ids))
            self.output_tokens.inc(len(req.tokens))
            q.put(_END if error is None else error)

        req.on_token, req.on_end = on_token, on_end

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


async def _watch(request: Any, reqs: list[Request]) -> None:
    """Cancel ``reqs`` when the client goes away (NOTE [serving requests])."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for r in reqs:
                r.cancel()
            return


def app(engine: Any, tok: Any, name: str, limits: Limits, default_stop: tuple[int, ...] = (), max_batch: int = 1):
    """The FastAPI application: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
    ``GET /metrics``; ``engine``: a :class:`~meshlm.infer.scheduler.Scheduler` or a static
    :class:`~meshlm.infer.static.Engine`."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    api = FastAPI(title="meshlm serve")
    metrics = Metrics(engine, max_batch)

    def error(status: int, msg: str, kind: str = "invalid_request_error") -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        return JSONResponse({"error": {"message": msg, "type": kind}}, status_code=status)

    async def tokens(q: _LoopQueue):
        while True:
            t = await q.get()
            if t is _END:
                return
            if isinstance(t, BaseException):
                raise t
            yield t

    def text(req: Request, toks: list[int]) -> str:
        return tok.decode([t for t in toks if t not in req.stop])

    @api.get("/health")
    async def health():
        return {
            "status": "ok",
            "running": engine.running,
            "waiting": engine.waiting,
            "steps": getattr(engine, "steps", None),
            "batches": getattr(engine, "batches", None),
        }

    @api.get("/metrics")
    async def prometheus():
        body, kind = metrics.text()
        return Response(body, media_type=kind)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "meshlm"}]}

    @api.post("/v1/completions")
    async def completions(request: HTTPRequest):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(422, f"the request body is not JSON: {e}")
        try:
            reqs, streamed = parse(body, tok, limits, default_stop)
        except ConfigError as e:
            return error(400, str(e))
        loop = asyncio.get_running_loop()
        queues = [_LoopQueue(loop) for _ in reqs]
        for r, q in zip(reqs, queues):
            metrics.attach(r, q)
        try:
            for r in reqs:
                engine.submit(r)
        except Stopped as e:
            for r in reqs:
                r.cancel()
            return error(503, str(e), "server_error")
        except ConfigError as e:  # what parse checks, checked again by the scheduler
            for r in reqs:
                r.cancel()
            return error(400, str(e))
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(i: int, t: str, finish: Optional[str]) -> dict:
            choice = {"index": i, "text": t, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [choice]}

        def finish(req: Request, toks: list[int]) -> str:
            return "stop" if toks and toks[-1] in req.stop else "length"

        if streamed:

            async def events():
                watcher = asyncio.ensure_future(_watch(request, reqs))
                status = 200
                try:
                    for i, (r, q) in enumerate(zip(reqs, queues)):
                        toks: list[int] = []
                        shown = ""
                        async for t in tokens(q):
                            toks.append(t)
                            now = text(r, toks)
                            if not now.endswith("\ufffd"):
                                yield f"data: {json.dumps(chunk(i, now[len(shown) :], None))}\n\n"
                                shown = now
                        yield f"data: {json.dumps(chunk(i, text(r, toks)[len(shown) :], finish(r, toks)))}\n\n"
                except Exception as e:
                    status = _status(e)
                    yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'code': status}})}\n\n"
                except BaseException:  # cancelled: the client went away
                    status = 499
                    raise
                finally:
                    watcher.cancel()
                    for r in reqs:
                        r.cancel()  # a request still decoding for a stream nobody reads leaves the batch
                    metrics.requests.labels(str(status)).inc()
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        watcher = asyncio.ensure_future(_watch(request, reqs))
        choices, used = [], 0
        try:
            for i, (r, q) in enumerate(zip(reqs, queues)):
                toks = [t async for t in tokens(q)]
                used += len(toks)
                choices.append({"index": i, "text": text(r, toks), "logprobs": None, "finish_reason": finish(r, toks)})
        except Exception as e:
            for r in reqs:
                r.cancel()
            status = _status(e)
            what = "generation failed: " if status == 500 else ""
            return error(status, f"{what}{e}", "server_error")
        finally:
            watcher.cancel()
        metrics.requests.labels("200").inc()
        usage = {"prompt_tokens": sum(len(r.ids) for r in reqs), "completion_tokens": used}
        usage["total_tokens"] = usage["prompt_tokens"] + used
        out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
        return {**out, "usage": usage}

    return api
