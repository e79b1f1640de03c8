"""Iteration-level scheduling (continuous batching) of generation requests over one model.

NOTE [continuous batching]
    A :class:`Scheduler` runs the model in a thread of its own and decodes every request in
    flight together, one token per request per iteration; a request joins at the next
    iteration after it arrives and leaves at the one where it ends, so its latency does not
    depend on the requests beside it or behind it (Orca's iteration-level scheduling; vLLM's
    continuous batching).  Each request holds one slot of a :class:`SlotCache` (NOTE [KV
    slots] in slots.py) of ``max_batch`` slots of ``context`` positions from admission to its
    end; more requests wait, first come first served.

    An iteration (:class:`Plan` in step.py) is at most two forwards: one prefill of the
    prompts of newly admitted requests (left-padded together, at most ``prefill_chunk`` padded
    tokens: a longer prompt is prefilled a chunk per iteration), then one decode step of every
    request already producing tokens.  So a new request's prefill delays the running ones by
    one forward, and a long prompt by one chunk per iteration.  The last position's logits
    of each row are turned into its request's next token with its own sampling options:
    greedy, or drawn from a generator of its own seed (one draw per token, as
    ``meshlm.infer.generate`` draws for a row), so a request's tokens are those it gets alone
    whatever else is decoded (greedy exactly; sampled given its seed).

    Between iterations the scheduler takes new requests, ends those cancelled
    (:meth:`Request.cancel`: the client went away) or past their ``timeout``, so they leave
    the batch within one iteration, and frees their slots for the next.  :meth:`Scheduler.stop`
    ends the loop at the next iteration, failing every request not done with :class:`Stopped`;
    :meth:`Scheduler.close` first serves every request submitted.

    Under a layout over several processes every rank must run the same forwards: rank 0's
    scheduler broadcasts each iteration's plan (slots freed, prompt chunks, tokens fed) before
    it runs it, and the other ranks run it too (:func:`meshlm.infer.step.follow`), until rank
    0 broadcasts None.  Only rank 0 samples; the other ranks learn the tokens from the next
    plan; an idle rank 0 broadcasts an empty plan every ``HEARTBEAT_S``, so that the others'
    wait in the broadcast never reaches the process group's timeout.  The scheduler knows
    nothing of HTTP: a request's tokens go to its ``on_token`` callback and its end (None,
    or the exception that ended it) to ``on_end``, both called on the scheduler's thread.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshlm.core.errors import ConfigError
from meshlm.infer.sample import Sampling, filter_logits, generators
from meshlm.infer.step import Plan, Runner, broadcast

HEARTBEAT_S = 30.0  # an idle rank 0 broadcasts an empty plan this often (the process group's timeout is longer)


class Stopped(RuntimeError):
    """The server stopped before this request was done."""


class TimedOut(RuntimeError):
    """The request ran past its timeout."""


class Cancelled(RuntimeError):
    """The request was cancelled (its client went away)."""


def _nothing(*_args) -> None:
    return None


@dataclass(eq=False)
class Request:
    """A prompt's token ids and how to continue it; ``timeout``: seconds from submission.
    The scheduler fills ``tokens``, ``finish`` (``stop``, ``length``, or the error's kind)
    and the times (``time.monotonic``) of submission, first token and end."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[int, ...] = ()
    timeout: Optional[float] = None
    #: the prompt's index among the prompts of its call: its random stream (NOTE [row streams]
    #: in meshlm/infer/sample.py), so it draws what ``generate`` draws for that prompt
    row: int = 0
    on_token: Callable[[int], None] = _nothing
    on_end: Callable[[Optional[BaseException]], None] = _nothing
    tokens: list[int] = field(default_factory=list)
    finish: Optional[str] = None
    submitted: float = 0.0
    first: Optional[float] = None
    ended: Optional[float] = None
    cancelled: bool = False

    def cancel(self) -> None:
        """Leave the batch at the next iteration (any thread may call this)."""
        self.cancelled = True


@dataclass(eq=False)
class _Live:
    req: Request
    slot: int
    fed: int = 0  # prompt tokens prefilled so far
    next: Optional[int] = None  # the token the next decode step feeds
    gen: Optional[torch.Generator] = None


class Scheduler:
    """Continuous batching of :class:`Request` s over ``model`` (NOTE [continuous batching])."""

    def __init__(
        self, model: nn.Module, max_batch: int = 8, context: int = 2048, prefill_chunk: int = 512, pad: int = 0
    ):
        if max_batch < 1 or context < 2 or prefill_chunk < 1:
            raise ConfigError(
                f"Scheduler: max_batch={max_batch}, context={context} and prefill_chunk={prefill_chunk} must be "
                "at least 1, 2 and 1"
            )
        self.runner = Runner(model, max_batch, context, pad)
        self.max_batch, self.context, self.prefill_chunk = max_batch, context, prefill_chunk
        self.vocab = getattr(getattr(model, "cfg", None), "vocab", None)
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.steps = 0
        self._in: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Live] = {}
        self._free = list(range(max_batch))  # a heap: the lowest free slot first (NOTE [KV slots])
        self._freed: list[int] = []
        self._closing = False
        self._told = time.monotonic()  # when the other ranks last heard from this one
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="meshlm-scheduler", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ from any thread
    def submit(self, req: Request) -> Request:
        """Queue ``req``; a ConfigError where it cannot be served (an empty prompt, a token
        outside the vocabulary, a prompt plus ``max_tokens`` beyond the context)."""
        if not req.ids:
            raise ConfigError("a request needs at least one prompt token")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ConfigError(f"max_tokens={req.max_tokens!r} must be a whole number >= 1")
        if len(req.ids) + req.max_tokens > self.context:
            raise ConfigError(
                f"a prompt of {len(req.ids)} tokens + max_tokens={req.max_tokens} = {len(req.ids) + req.max_tokens} "
                f"exceeds the context of {self.context} tokens"
            )
        if self.vocab is not None and not all(0 <= t < self.vocab for t in req.ids):
            bad = next(t for t in req.ids if not 0 <= t < self.vocab)
            raise ConfigError(f"token id {bad} is outside the model's vocabulary of {self.vocab}")
        req.submitted = time.monotonic()
        if self._stopping.is_set() or self._closing:
            raise Stopped("the server is shutting down")
        self._in.put(req)
        return req

    @property
    def waiting(self) -> int:
        """Requests queued, not yet holding a slot."""
        return len(self._waiting) + self._in.qsize()

    @property
    def running(self) -> int:
        """Requests holding a slot (the batch's occupancy)."""
        return len(self._running)

    def close(self) -> None:
        """Serve every request submitted, then end (and the other ranks' ``follow``)."""
        self._closing = True
        self._in.put(None)
        self.thread.join()

    def stop(self, timeout: float) -> bool:
        """End at the next iteration: the requests not done fail with :class:`Stopped`;
        True when the loop has ended within ``timeout`` seconds (0: do not wait)."""
        self._stopping.set()
        self._in.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # ------------------------------------------------------------------ the scheduler's thread
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._take():
                    break
                plan, pre, dec = self._plan()
                if not (plan.prefill or plan.decode):
                    if self.ranks > 1 and time.monotonic() - self._told > HEARTBEAT_S:
                        try:  # idle: the other ranks' wait must not reach the group's timeout
                            broadcast(Plan())
                        except Exception:  # noqa: BLE001 - the other ranks are gone: nothing can be served
                            return
                        self._told = time.monotonic()
                    continue
                del self._freed[: len(plan.free)]  # the followers free them with this plan
                try:
                    if self.ranks > 1:
                        broadcast(plan)
                        self._told = time.monotonic()
                    pre_logits, dec_logits = self.runner.run(plan)
                except Exception as e:  # the requests of this iteration fail; the scheduler goes on
                    for live in pre + dec:
                        self._end(live, "error", e)
                    continue
                self.steps += 1
                for i, live in enumerate(pre):
                    if live.fed == len(live.req.ids):  # the prompt's last chunk: its first token
                        self._emit(live, pre_logits[i])
                for i, live in enumerate(dec):
                    self._emit(live, dec_logits[i])
        finally:
            for live in list(self._running.values()):
                self._end(live, "stopped", Stopped("the server is shutting down"))
            for req in self._drain():
                self._finish(req, "stopped", Stopped("the server is shutting down"))
            if self.ranks > 1:
                try:
                    broadcast(None)
                except Exception:  # noqa: BLE001 - the other ranks are gone already
                    pass

    def _drain(self) -> list[Request]:
        out = list(self._waiting)
        self._waiting.clear()
        while True:
            try:
                r = self._in.get_nowait()
            except queue.Empty:
                return out
            if r is not None:
                out.append(r)

    def _take(self) -> bool:
        """New requests into the queue (waiting for one when nothing is in flight); False
        when the loop should end (stopped, or closed with every request served)."""
        while True:
            idle = not (self._waiting or self._running)
            if idle and self._closing and self._in.empty():
                return False
            try:
                wait = HEARTBEAT_S if self.ranks > 1 else None
                r = self._in.get(timeout=wait) if idle else self._in.get_nowait()
            except queue.Empty:
                return True
            if self._stopping.is_set():
                return False
            if r is not None:
                self._waiting.append(r)

    def _plan(self) -> tuple[Plan, list[_Live], list[_Live]]:
        now = time.monotonic()
        for live in list(self._running.values()):
            why = self._why_end(live.req, now)
            if why is not None:
                self._end(live, *why)
        for req in list(self._waiting):
            why = self._why_end(req, now)
            if why is not None:
                self._waiting.remove(req)
                self._finish(req, *why)
        while self._free and self._waiting:
            req = self._waiting.popleft()
            slot = heapq.heappop(self._free)
            gen = None if req.sampling.greedy else generators(req.sampling, [req.row])[0]
            self._running[slot] = _Live(req, slot, gen=gen)
        plan = Plan(free=list(self._freed))
        pre: list[_Live] = []
        width = 0
        for live in sorted(self._running.values(), key=lambda x: x.req.submitted):
            left = len(live.req.ids) - live.fed
            if left == 0:
                continue
            w = max(width, min(left, self.prefill_chunk))
            if pre and (len(pre) + 1) * w > self.prefill_chunk:
                break
            n = min(left, self.prefill_chunk)
            plan.prefill.append((live.slot, live.req.ids[live.fed : live.fed + n]))
            live.fed += n
            pre.append(live)
            width = w
        dec = [x for _, x in sorted(self._running.items()) if x.next is not None]
        plan.decode = [(x.slot, x.next) for x in dec]
        return plan, pre, dec

    @staticmethod
    def _why_end(req: Request, now: float) -> Optional[tuple[str, BaseException]]:
        if req.cancelled:
            return "cancelled", Cancelled("the request was cancelled")
        if req.timeout is not None and now - req.submitted > req.timeout:
            return "timeout", TimedOut(f"the request ran past its timeout of {req.timeout:g} s")
        return None

    def _choose(self, live: _Live, logits: Tensor) -> int:
        s = live.req.sampling
        if s.greedy:
            return int(logits.argmax())
        probs = filter_logits(logits[None], s).softmax(-1)[0]
        return int(torch.multinomial(probs, 1, generator=live.gen))

    def _emit(self, live: _Live, logits: Tensor) -> None:
        req = live.req
        t = self._choose(live, logits)
        req.tokens.append(t)
        if req.first is None:
            req.first = time.monotonic()
        _call(req.on_token, t)
        if t in req.stop:
            self._end(live, "stop")
        elif len(req.tokens) >= req.max_tokens:
            self._end(live, "length")
        else:
            live.next = t

    def _end(self, live: _Live, finish: str, error: Optional[BaseException] = None) -> None:
        del self._running[live.slot]
        heapq.heappush(self._free, live.slot)
        self._freed.append(live.slot)
        self._finish(live.req, finish, error)

    @staticmethod
    def _finish(req: Request, finish: str, error: Optional[BaseException] = None) -> None:
        req.finish, req.ended = finish, time.monotonic()
        _call(req.on_end, error)


def _call(fn: Callable, arg) -> None:
    try:
        fn(arg)
    except Exception:  # noqa: BLE001 - a callback's failure is its request's, never the scheduler's
        pass
