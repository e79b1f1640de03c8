"""Placement under a memory limit for inference: which blocks stay in the device's memory
and which are streamed in from host memory or disk when they are used (Accelerate's
``device_map="auto"`` with CPU and disk offload, on one device).

NOTE [inference placement]
    What a model needs in memory to decode a batch of ``batch`` rows up to ``context``
    positions is measured, not assumed: the model is run once on the meta device (no
    memory, any size) with a KV cache of that batch and context, which gives each block's KV
    cache bytes from the buffers the cache allocates, and the prefill's working memory: twice
    the largest tensor any op of that forward returns (an op's output and an input of the
    same order live together; attention counted by its output, as a fused kernel runs it;
    for Llama, the MLP's hidden activation of every prompt position, or the logits of every
    position where a model ignores ``cache.last_only``, NOTE [KV cache]), an estimate rather
    than a measured peak.
    Each block's parameter bytes are its parameters', those outside blocks (embeddings,
    head, final norm) counted once.  So any model that meets the KV cache contract is placed
    without a formula of its own.

    The placement keeps, in block order, as many blocks resident as fit under
    ``max_memory`` next to everything that must stay: the parameters outside blocks, every
    block's KV cache (a streamed block's too: only parameters move), the prefill's working
    memory and, once any block is streamed, room for two streamed blocks' parameters (the one
    running and the next, read ahead).  The remaining blocks (the last ones) are streamed:
    their parameters live on the tier and come in for each forward (meshlm's
    ``offload.params`` machinery, NOTE [offloaded parameters] in meshlm/runtime/offload/params.py),
    so a decode step reads every streamed block once.  A limit below what must stay is an
    error that says how much is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from meshlm import _torch_compat as compat
from meshlm._torch_compat import TorchDispatchMode
from meshlm.core.annotate import outer_blocks
from meshlm.core.errors import ConfigError

MiB = 2**20


@dataclass
class Placement:
    """Where each block lives: ``stages[d]`` the blocks resident on device ``d`` (contiguous,
    in order), ``streamed`` the last blocks, run on the last device with their parameters on
    ``tier``.  Bytes are per device."""

    max_memory: int
    batch: int
    context: int
    block_params: list[int]
    block_kv: list[int]
    outside: int
    output: int
    stages: list[list[int]] = field(default_factory=lambda: [[]])
    streamed: list[int] = field(default_factory=list)
    tier: str = "disk"

    @property
    def devices(self) -> int:
        return len(self.stages)

    @property
    def resident(self) -> list[int]:
        return [i for st in self.stages for i in st]

    def owner(self, i: int) -> int:
        """The device that runs block ``i``."""
        return next((d for d, st in enumerate(self.stages) if i in st), self.devices - 1)

    @property
    def stream_buffer(self) -> int:
        """Room for a streamed block running and the next read ahead."""
        big = sorted((self.block_params[i] for i in self.streamed), reverse=True)
        return sum(big[:2])

    def runs(self, d: int) -> list[int]:
        """The blocks device ``d`` runs: its stage, and on the last device the streamed ones."""
        return self.stages[d] + (self.streamed if d == self.devices - 1 else [])

    def parts(self, d: int = 0) -> dict[str, int]:
        last = d == self.devices - 1
        runs = self.runs(d)
        return {
            "parameters outside blocks": self.outside,
            "resident blocks' parameters": sum(self.block_params[i] for i in self.stages[d]),
            "KV cache": sum(self.block_kv[i] for i in runs),
            "prefill activations": self.output,
            "streamed blocks in flight": self.stream_buffer if last else 0,
        }

    def total(self, d: int) -> int:
        return sum(self.parts(d).values())

    @property
    def device_bytes(self) -> int:
        """The most any device needs."""
        return max(self.total(d) for d in range(self.devices))

    @property
    def tier_bytes(self) -> int:
        return sum(self.block_params[i] for i in self.streamed)

    def describe(self) -> str:
        n = len(self.block_params)
        lines = [
            f"placement: {n - len(self.streamed)} of {n} blocks resident, {len(self.streamed)} streamed from "
            f"{self.tier}; batch {self.batch}, context {self.context}; limit {self.max_memory / MiB:,.2f} MiB"
            + (f" on each of {self.devices} devices" if self.devices > 1 else "")
        ]
        for d in range(self.devices):
            if self.devices > 1:
                st = self.runs(d)
                lines.append(f"device {d}: blocks {st[0]}..{st[-1]}" if st else f"device {d}: no blocks")
            lines += [f"  {k:<28} {v / MiB:>10,.2f} MiB" for k, v in self.parts(d).items()]
            lines.append(f"  {'device total':<28} {self.total(d) / MiB:>10,.2f} MiB")
        lines.append(f"  {'on ' + self.tier:<28} {self.tier_bytes / MiB:>10,.2f} MiB")
        if self.streamed:
            lines.append(f"  streamed blocks: {self.streamed[0]}..{self.streamed[-1]} (read once per forward)")
        return "\n".join(lines)


def _param_bytes(params) -> int:
    seen: dict[int, int] = {}
    for p in params:
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def measure(meta_model: nn.Module, batch: int, context: int) -> tuple[list[int], list[int], int, int]:
    """(each block's parameter bytes, each block's KV bytes, bytes outside blocks, prefill
    output bytes) of ``meta_model`` (on the meta device) for ``batch`` x ``context``."""
    from meshlm.infer.cache import KVCache

    blocks = outer_blocks(meta_model)
    if not blocks:
        raise ConfigError(
            f"placement: {type(meta_model).__name__} has no @meshlm.block modules; blocks are the unit "
            "a placement keeps or streams"
        )
    block_params = [_param_bytes(b.parameters()) for b in blocks]
    inside = {id(p) for b in blocks for p in b.parameters()}
    outside = _param_bytes(p for p in meta_model.parameters() if id(p) not in inside)
    # as the generate loop makes it (last_only: the logits it holds); static: no data-dependent branch
    cache = KVCache(batch, context, device="meta", static=True, last_only=True)
    cache.begin(torch.ones(batch, context, dtype=torch.bool, device="meta"))
    big = _Largest()
    with torch.no_grad(), _FusedAttention(big), big:
        out = meta_model(torch.zeros(batch, context, dtype=torch.long, device="meta"), cache=cache)
    cache.end()
    if sorted(cache._kv) != list(range(len(blocks))):
        fewer = len(cache._kv) < len(blocks)
        raise ConfigError(
            f"placement: the model's forward wrote KV cache layers {sorted(cache._kv)}, not one per block "
            f"(0..{len(blocks) - 1}): it must hand block i the view cache.layer(i) (NOTE [KV cache])"
            + (
                f". {type(meta_model).__name__} has {len(blocks)} blocks of which {len(cache._kv)} decode with a "
                "cache (a vision-language model's encoder blocks take none): --max-memory-per-device places "
                "decoder-only models; run this one without it (--layout tp --mesh tp=N splits it)"
                if fewer
                else ""
            )
        )
    kv = [sum(t.numel() * t.element_size() for t in cache._kv[i]) for i in range(len(blocks))]
    return block_params, kv, outside, max(out.numel() * out.element_size(), 2 * big.bytes)


class _Largest(TorchDispatchMode):
    """The bytes of the largest tensor any op returns (an estimate of a forward's working
    memory: that tensor and the op's input of the same order live together)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.inside_attention = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an op whose result aliases an input (a view, as a weight's transpose) makes no new memory
        views = any(r.alias_info is not None for r in func._schema.returns)
        if not self.inside_attention and not views:
            for t in compat.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Counts scaled_dot_product_attention by its output: on the meta device it runs the
    math decomposition, whose (batch, heads, queries, keys) scores the fused kernels that
    run it for real never hold whole."""

    def __init__(self, big: _Largest):
        super().__init__()
        self.big = big

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.big.inside_attention = True
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.big.inside_attention = False
        self.big.bytes = max(self.big.bytes, out.numel() * out.element_size())
        return out


def place(
    meta_model: nn.Module, max_memory: float, batch: int, context: int, tier: str = "disk", devices: int = 1
) -> Placement:
    """The placement of NOTE [inference placement] over ``devices`` devices: the blocks split
    evenly (contiguous) if that fits; otherwise each device but the last filled in order, and
    the last keeping what fits and streaming the rest."""
    bp, kv, outside, output = measure(meta_model, batch, context)
    n = len(bp)
    pl = Placement(int(max_memory), batch, context, bp, kv, outside, output, tier=tier)
    bounds = [n * d // devices for d in range(devices + 1)]
    pl.stages = [list(range(bounds[d], bounds[d + 1])) for d in range(devices)]
    if pl.device_bytes <= pl.max_memory:
        return pl
    pl.stages, start = [], 0
    for d in range(devices - 1):
        stop = start
        pl.stages.append([])
        while stop < n and pl.total(d) + bp[stop] + kv[stop] <= pl.max_memory:
            stop += 1
            pl.stages[d] = list(range(start, stop))
        start = stop
    pl.stages.append([])
    for k in range(n - start + 1):  # the last device streams the last k blocks, the fewest that fit
        pl.stages[-1] = list(range(start, n - k))
        pl.streamed = list(range(n - k, n))
        if pl.total(devices - 1) <= pl.max_memory:
            return pl
    need = pl.total(devices - 1)
    raise ConfigError(
        f"--max-memory-per-device={max_memory / MiB:,.2f} MiB: even with every block streamed from {tier}, "
        f"decoding {batch} rows of up to {context} positions needs {need / MiB:,.2f} MiB on the device "
        f"(parameters outside blocks {outside / MiB:,.2f}, KV cache {pl.parts(devices - 1)['KV cache'] / MiB:,.2f}, "
        f"prefill activations {output / MiB:,.2f}, two streamed blocks {pl.stream_buffer / MiB:,.2f}): raise the "
        "limit, or shorten the context or the batch"
    )


def swapper(pl: Placement, directory: Optional[str] = None) -> Any:
    """The tier the placement streams from (a disk tier in ``directory``: its own run
    directory there, removed at exit)."""
    import tempfile

    from meshlm.runtime.offload.store import SwapDir, Swapper

    disk = SwapDir(directory or tempfile.gettempdir() + "/meshlm-offload") if pl.tier == "disk" else None
    return Swapper(pl.tier, disk)


def spill(pl: Placement, sw: Any) -> Any:
    """A callback for building the model block by block (``load_hf_local(after_block=)``):
    a streamed block's parameters go to the tier as soon as they are read, so the model is
    never whole in memory."""

    from meshlm.runtime.memory import local_data

    def after(i: int, blk: nn.Module) -> None:
        if i in pl.streamed:
            for p in blk.parameters():
                sw.swap_out(local_data(p))  # the object the swapper and ParamOffload key by

    return after


def stream_blocks(model: nn.Module, pl: Placement, sw: Any) -> Any:
    """Stream the placement's blocks of the live ``model`` from ``sw``'s tier: their
    parameters come in for each forward (NOTE [offloaded parameters]).  Returns the
    :class:`meshlm.runtime.offload.params.ParamOffload` (``close()`` it when done), or None."""
    if not pl.streamed:
        return None
    from meshlm.runtime.offload.params import ParamOffload

    off = ParamOffload(model, sw, only=pl.streamed)
    off.swap_out_all()
    return off
