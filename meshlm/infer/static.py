"""Static batching: the serving loop ``meshlm serve --scheduler static`` runs, kept to compare
with the continuous scheduler (NOTE [continuous batching] in scheduler.py; benchmarks/serve_load.py).

NOTE [static batching]
    The model runs in one thread (the *engine*), which takes the requests waiting in its
    queue, up to ``max_batch`` of those with the same sampling options and stop tokens, and
    decodes them as one left-padded batch (a row computes what its prompt alone would, NOTE
    [KV cache]) until every row has reached its own ``max_tokens`` or stop token; only then
    does any request of the batch end, and only then is the next batch taken.  So a short
    request batched with a long one, or queued behind it, waits for it (head-of-line
    blocking), and a request's latency is its batch's.  Tokens go to each request's
    ``on_token`` as they are made.  It has no timeout and no cancellation.

    Under a layout over several processes rank 0 broadcasts each batch (prompts and options)
    to the other ranks, which decode along in :func:`follow`; an empty broadcast stops them.
    :meth:`Engine.stop` ends the batch being decoded at its next token on one process (a
    layout over several processes decodes in lockstep with rank 0, so there the batch runs to
    its end unless the other ranks are gone) and fails every waiting request.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from meshlm.infer.generate import stream
from meshlm.infer.scheduler import Request, Stopped
from meshlm.infer.step import broadcast


class Engine:
    """The model's thread: batches of waiting requests, decoded together (NOTE [static batching])."""

    def __init__(self, model: Any, max_batch: int = 8, compile: Optional[str] = None):
        """``compile``: a torch.compile backend for the decode step (NOTE [compiled decode])."""
        self.model, self.max_batch, self.compile = model, max_batch, compile
        self.jobs: "queue.Queue[Optional[Request]]" = queue.Queue()
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.batches = 0
        self.running = 0  # requests in the batch being decoded
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> Request:
        req.submitted = time.monotonic()
        self.jobs.put(req)
        return req

    @property
    def waiting(self) -> int:
        """Requests queued for a later batch."""
        return self.jobs.qsize()

    def close(self) -> None:
        """Serve every request submitted, then end the engine (and the other ranks' ``follow``)."""
        self.jobs.put(None)
        self.thread.join()

    def stop(self, timeout: float) -> bool:
        """End now (NOTE [static batching]): the requests not done fail with :class:`Stopped`;
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
                _end(j, "stopped", Stopped("the server is shutting down"))

    def _take(self) -> Optional[list[Request]]:
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
                        broadcast(None)
                    except Exception:  # noqa: BLE001 - the other ranks are gone already
                        pass
                return
            spec = ([j.ids for j in batch], max(j.max_tokens for j in batch), batch[0].sampling, batch[0].stop)
            self.running = len(batch)
            try:
                if self.ranks > 1:
                    broadcast(spec)  # fails at once when the other ranks are gone: so does this batch
                done = [False] * len(batch)
                count = [0] * len(batch)
                for step in decode(self.model, spec, self.compile):
                    if self._stopping.is_set() and self.ranks == 1:
                        raise Stopped("the server is shutting down")
                    for i, t in step:
                        if done[i]:
                            continue
                        j = batch[i]
                        j.tokens.append(t)
                        if j.first is None:
                            j.first = time.monotonic()
                        j.on_token(t)
                        count[i] += 1
                        done[i] = t in j.stop or count[i] >= j.max_tokens
                self.batches += 1
                for j in batch:  # every request of the batch ends with it
                    _end(j, "stop" if j.tokens and j.tokens[-1] in j.stop else "length")
            except Exception as e:  # the requests of this batch fail; the engine goes on
                for j in batch:
                    _end(j, "stopped" if isinstance(e, Stopped) else "error", e)
            self.running = 0


def _end(req: Request, finish: str, error: Optional[BaseException] = None) -> None:
    req.finish, req.ended = finish, time.monotonic()
    req.on_end(error)


def decode(model: Any, spec: tuple, compile: Optional[str] = None) -> Any:
    prompts, max_new, sampling, stop = spec
    return stream(model, prompts, max_new_tokens=max_new, sampling=sampling, stop=stop, compile=compile)


def follow(model: Any, compile: Optional[str] = None) -> None:
    """A rank other than 0: decode every batch rank 0 broadcasts, until it broadcasts None."""
    while True:
        spec = broadcast(None)
        if spec is None:
            return
        for _ in decode(model, spec, compile):
            pass
