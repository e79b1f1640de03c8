"""Inference: a KV cache (NOTE [KV cache] in cache.py), sampling (sample.py) and the
generate loop (generate.py; its compiled step, compiled.py), for any model that meets the
cache contract, on one device or sharded under a layout.  Imports flow cli -> generate ->
cache, compiled, sample."""

from meshlm.infer.cache import KVCache
from meshlm.infer.generate import generate, stream
from meshlm.infer.sample import Sampling

__all__ = ["KVCache", "Sampling", "generate", "stream"]
