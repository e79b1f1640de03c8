"""``meshlm serve``: an OpenAI-compatible completions server (FastAPI on uvicorn, the
``serve`` extra) over a model under any inference layout.

NOTE [serving loop]
    HTTP requests are handled by uvicorn's event loop; the model runs in one thread of its
    own (the *engine*), which takes the requests waiting in its queue, up to
    ``max_batch`` of those with the same sampling options and stop tokens, and decodes them as
    one left-padded batch (a row computes what its prompt alone would, NOTE [KV cache]); each
    request's tokens go back to its handler as they are made, which streams them (server-sent
    events) or returns the text at the end.  A row that reached its own ``max_tokens`` or
    stop token is done for its request; the batch decodes until every row is.

    Under a layout over several processes every rank must run the same forward: rank 0
    serves HTTP and, before each batch, broadcasts it (prompts and options) to the other
    ranks, which wait in :func:`follow` and decode along; an empty broadcast stops them.

    Stopping (NOTE [stopping a server] in meshlm/app/serve.py): :meth:`Engine.stop` ends the batch
    being decoded at its next token on one process, failing its requests, and every waiting
    request (a layout over several processes decodes in lockstep with rank 0, so there the
    batch runs to its end unless the other ranks are gone, which fails it at once).  Tokens
    reach the handlers through the event loop (``call_soon_threadsafe``), never through a
    thread blocked on a queue, so no executor thread outlives a cancelled request.

    A request that cannot be served is refused before it reaches the engine, with a 4xx and
    the reason (malformed JSON or a field of the wrong type: 422; an unknown field, a value out
    of range, a prompt longer than the model's context: 400); the server stays up.  An error
    inside the engine fails the requests of that batch with a 500 and the engine goes on.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations
# (``Request``, imported inside ``app``) at run time.
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from meshlm.core.errors import ConfigError
from meshlm.infer.generate import stop_id, stream
from meshlm.infer.sample import Sampling


@dataclass
class Job:
    """One request's prompt (token ids) and options, and where its tokens go."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[int, ...]
    out: Any = field(default_factory=queue.Queue)  # token ids, then None (or an Exception): a queue.Queue or _LoopQueue


class _LoopQueue:
    """Where the engine's thread puts a request's tokens for its handler on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.q = loop, asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits for it
            pass

    async def get(self) -> Any:
        return await self.q.get()


class Stopped(RuntimeError):
    """The server stopped before this request was done."""


def _bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Engine:
    """The model's thread: batches of waiting jobs, decoded together (NOTE [serving loop])."""

    def __init__(self, model: Any, max_batch: int = 8, compile: Optional[str] = None):
        """``compile``: a torch.compile backend for the decode step (NOTE [compiled decode])."""
        self.model, self.max_batch, self.compile = model, max_batch, compile
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.batches = 0
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Serve every request submitted, then end the engine (and the other ranks' ``follow``)."""
        self.jobs.put(None)
        self.thread.join()

    def stop(self, timeout: float) -> bool:
        """End now (NOTE [serving loop]): the requests not done fail with :class:`Stopped`;
        True when the engine has ended within ``timeout`` seconds (0: do not wait)."""
        if not self._stopping.is_set():
            self._stopping.set()
            self.jobs.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _fail_waiting(self) -> None:
        while True:
            try:
                j = self.jobs.get_nowait()
            except queue.Empty:
                return
            if j is not None:
                j.out.put(Stopped("the server is shutting down"))

    def _take(self) -> Optional[list[Job]]:
        first = self.jobs.get()
        if first is None:
            return None
        batch, later = [first], []
        time.sleep(0.005)  # let requests that arrive together share the batch
        while len(batch) < self.max_batch:
            try:
                j = self.jobs.get_nowait()
            except queue.Empty:
                break
            if j is None:
                later.append(j)
                break
            same = (j.sampling, j.stop) == (first.sampling, first.stop)
            (batch if same else later).append(j)
        for j in later:  # back in line, in order, for the next batch
            self.jobs.put(j)
        return batch

    def _loop(self) -> None:
        while True:
            batch = None if self._stopping.is_set() else self._take()
            if batch is None:
                self._fail_waiting()
                if self.ranks > 1:
                    try:
                        _bcast(None)
                    except Exception:  # noqa: BLE001 - the other ranks are gone already
                        pass
                return
            spec = ([j.ids for j in batch], max(j.max_tokens for j in batch), batch[0].sampling, batch[0].stop)
            try:
                if self.ranks > 1:
                    _bcast(spec)  # fails at once when the other ranks are gone: so does this batch
                done = [False] * len(batch)
                count = [0] * len(batch)
                for step in decode(self.model, spec, self.compile):
                    if self._stopping.is_set() and self.ranks == 1:
                        raise Stopped("the server is shutting down")
                    for i, t in step:
                        if done[i]:
                            continue
                        batch[i].out.put(t)
                        count[i] += 1
                        done[i] = t in batch[i].stop or count[i] >= batch[i].max_tokens
                self.batches += 1
                for j in batch:
                    j.out.put(None)
            except Exception as e:  # the requests of this batch fail; the engine goes on
                for j in batch:
                    j.out.put(e)


def decode(model: Any, spec: tuple, compile: Optional[str] = None) -> Any:
    prompts, max_new, sampling, stop = spec
    return stream(model, prompts, max_new_tokens=max_new, sampling=sampling, stop=stop, compile=compile)


def follow(model: Any, compile: Optional[str] = None) -> None:
    """A rank other than 0: decode every batch rank 0 broadcasts, until it broadcasts None."""
    while True:
        spec = _bcast(None)
        if spec is None:
            return
        for _ in decode(model, spec, compile):
            pass


# ------------------------------------------------------------------------------ HTTP
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "user"}


def parse(body: Any, tok: Any, ctx: Optional[int], default_stop: tuple[int, ...]) -> list[Job]:
    """The jobs of a completions request (one per prompt); a ConfigError says what is wrong."""
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ConfigError(f"unknown field {unknown[0]!r}; this server takes: {', '.join(sorted(KNOWN))}")
    prompts = body.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError("`prompt` must be a non-empty string or a list of them")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ConfigError(f"`max_tokens`={max_tokens!r} must be a whole number >= 1")
    opts = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed") if body.get(k) is not None}
    for k, v in opts.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"`{k}`={v!r} must be a number")
    sampling = Sampling.from_dict(opts)
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else (stops or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ConfigError("`stop` must be a string or a list of strings")
    stop_ids = list(default_stop) + [stop_id(tok, s, "`stop`") for s in stops]
    jobs = []
    for p in prompts:
        ids = tok.encode(p).tolist()
        if ctx is not None and len(ids) + max_tokens > ctx:
            raise ConfigError(
                f"the prompt of {len(ids)} tokens + max_tokens={max_tokens} exceeds the context of {ctx} tokens "
                "this server takes"
            )
        jobs.append(Job(ids, max_tokens, sampling, tuple(stop_ids)))
    return jobs


def app(engine: Engine, tok: Any, name: str, default_stop: tuple[int, ...] = (), context: Optional[int] = None) -> Any:
    """The FastAPI application: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
    ``context``: the longest prompt + ``max_tokens`` taken (the model's own limit, or the one
    the server was placed for)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    api = FastAPI(title="meshlm serve")

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=status)

    async def tokens(job: Job):
        while True:
            t = await job.out.get()
            if t is None:
                return
            if isinstance(t, Exception):
                raise t
            yield t

    def text(job: Job, toks: list[int]) -> str:
        return tok.decode([t for t in toks if t not in job.stop])

    @api.get("/health")
    async def health():
        return {"status": "ok", "batches": engine.batches}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "meshlm"}]}

    @api.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(422, f"the request body is not JSON: {e}")
        try:
            jobs = parse(body, tok, context, default_stop)
        except ConfigError as e:
            return error(400, str(e))
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        loop = asyncio.get_running_loop()
        for j in jobs:
            j.out = _LoopQueue(loop)
            engine.submit(j)

        def chunk(i: int, t: str, finish: Optional[str]) -> dict:
            choice = {"index": i, "text": t, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [choice]}

        def finish(job: Job, toks: list[int]) -> str:
            return "stop" if toks and toks[-1] in job.stop else "length"

        if body.get("stream"):

            async def events():
                try:
                    for i, j in enumerate(jobs):
                        toks: list[int] = []
                        shown = ""
                        async for t in tokens(j):
                            toks.append(t)
                            now = text(j, toks)
                            if not now.endswith("\ufffd"):
                                yield f"data: {json.dumps(chunk(i, now[len(shown) :], None))}\n\n"
                                shown = now
                        yield f"data: {json.dumps(chunk(i, text(j, toks)[len(shown) :], finish(j, toks)))}\n\n"
                except Exception as e:
                    yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        choices, used = [], 0
        try:
            for i, j in enumerate(jobs):
                toks = [t async for t in tokens(j)]
                used += len(toks)
                choices.append({"index": i, "text": text(j, toks), "logprobs": None, "finish_reason": finish(j, toks)})
        except Exception as e:
            return error(500, f"generation failed: {e}")
        usage = {"prompt_tokens": sum(len(j.ids) for j in jobs), "completion_tokens": used}
        usage["total_tokens"] = usage["prompt_tokens"] + used
        out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
        return {**out, "usage": usage}

    return api
