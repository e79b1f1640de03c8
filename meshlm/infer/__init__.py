"""Inference: a KV cache (NOTE [KV cache] in cache.py), sampling (sample.py) and the
generate loop (generate.py; its compiled step, compiled.py), for any model that meets the
cache contract, on one device or sharded under a layout; and the server's continuous
batching (NOTE [continuous batching] in scheduler.py) over per-request KV slots (slots.py),
one plan per iteration run on every rank (step.py), with the earlier static batching kept
in static.py.  Imports flow cli -> generate -> cache, compiled, sample; scheduler -> step ->
slots -> cache."""

from meshlm.infer.cache import KVCache
from meshlm.infer.generate import generate, stream
from meshlm.infer.sample import Sampling

__all__ = ["KVCache", "Sampling", "generate", "stream"]
