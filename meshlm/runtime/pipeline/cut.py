"""Where a model is cut into pipeline stages: a probe of its forward on shapes only, and
the blocks, parameters and segments of code each stage runs for real.

NOTE [pipeline cut]
    Stages are cut at block boundaries (outer ``@meshlm.block`` modules).  ``probe`` runs
    the model's forward once on ``Absent`` tensors (NOTE [absent values] in
    meshlm/runtime/absent.py: every parameter an ``Absent`` of its shape; no data, no device
    memory) and records, in call order, the blocks it enters and each parameter it uses.
    That splits the forward into segments: *pre* (before the first block), block ``i``,
    and the code after block ``i`` up to the next block (or the end of the forward).  A
    stage holds a run of consecutive blocks; the pre segment runs on stage 0, and the code
    after a block on that block's stage, so the last stage runs the code after the last
    block (the final norm, the head, the loss).  A parameter belongs to the stage of the
    segments that use it, and must be used by one stage only: a parameter used by two
    stages (a head tied to the embedding, used first and last) is an error that names it.

    What crosses a boundary is the first positional argument of the next stage's first
    block, the hidden state (its other arguments must not depend on parameters of earlier
    stages: the receiving stage recomputes them, from the inputs and buffers it sees),
    together with the tensors the blocks of earlier stages return after their hidden state
    (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py: a mixture of experts' auxiliary
    losses).

    Blocks are balanced by parameter count (with the pre and post parameters counted on
    the first and last stage), or split by hand (``split``: blocks per stage).  With
    ``v`` stages per rank (interleaved and V-shaped schedules) stage ``s`` runs on pp rank
    ``s % p`` ("loop") or, V-shaped, ``s`` for ``s < p`` and ``2p - 1 - s`` after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from meshlm.core.annotate import outer_blocks
from meshlm.core.errors import ConfigError
from meshlm.core.state import scope
from meshlm.runtime import absent, hooks

PRE = -1  # the segment before the first block


@dataclass
class Probe:
    """What one forward on shapes saw (NOTE [pipeline cut])."""

    blocks: list[str]  # outer blocks' FQNs, in call order
    numel: dict[str, int]  # parameter FQN -> elements
    uses: dict[str, set[int]]  # parameter FQN -> segments using it (PRE, or the index of the block before)
    draws: dict[str, bool]  # block FQN -> whether its forward drew from torch's generator (dropout keys)
    same_shape: dict[str, bool]  # block FQN -> returns one tensor shaped like its first argument
    shapes: dict[str, tuple] = field(default_factory=dict)  # block FQN -> global shape of its first argument
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # block FQN -> dtype of its first argument
    # block FQN -> whether the forward draws from torch's generator from that block's entry on
    tail_draws: dict[str, bool] = field(default_factory=dict)
    inside: dict[str, str] = field(default_factory=dict)  # parameter FQN -> its outer block's FQN
    # block FQN -> its side outputs (NOTE [side outputs] in stage.py): (position in the
    # returned tuple, global shape, dtype) of each tensor it returns after the hidden state
    sides: dict[str, tuple] = field(default_factory=dict)


def probe(shadow: nn.Module, args: Sequence[Any], kwargs: Optional[dict] = None) -> Probe:
    """Run ``shadow`` (a model built on the meta device) once on ``Absent`` inputs and
    record its blocks and the segments each parameter is used in (NOTE [pipeline cut]).
    Its parameters become ``Absent`` attributes; torch's generator is left as it was."""
    names = {id(m): n for n, m in shadow.named_modules()}
    blocks = outer_blocks(shadow)
    inside: dict[str, str] = {}
    for blk in blocks:
        for pn, _p in blk.named_parameters():
            inside[f"{names[id(blk)]}.{pn}"] = names[id(blk)]
    params: dict[int, str] = {}
    numel: dict[str, int] = {}
    for mname, m in shadow.named_modules(remove_duplicate=False):
        for n, p in list(m._parameters.items()):
            if p is None:
                continue
            fqn = params.setdefault(id(p), f"{mname}.{n}" if mname else n)
            numel[fqn] = p.numel()
    made: dict[int, absent.Absent] = {}  # a tied parameter's slots share one Absent
    held: dict[int, str] = {}  # id of each parameter's Absent (alive: an attribute) -> FQN
    for mname, m in shadow.named_modules(remove_duplicate=False):
        for n, p in list(m._parameters.items()):
            if p is not None:
                del m._parameters[n]
                a = made.setdefault(id(p), absent.absent_like(p))
                setattr(m, n, a)
                held[id(a)] = params[id(p)]
    params = held
    order: list[str] = []
    uses: dict[str, set[int]] = {fqn: set() for fqn in numel}
    draws: dict[str, bool] = {}
    same: dict[str, bool] = {}
    sides: dict[str, tuple] = {}
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, torch.dtype] = {}
    at_entry: dict[str, torch.Tensor] = {}
    seg = [PRE]

    def on_use(ts) -> None:
        for t in ts:
            fqn = params.get(id(t))
            if fqn is not None:
                uses[fqn].add(seg[0])

    def enter(blk, args, kwargs):
        fqn = names[id(blk)]
        if fqn in draws:
            raise ConfigError(
                f"pipeline parallelism: block `{fqn}` is called twice in one forward; a stage holds each block "
                "once, so every block must be called exactly once"
            )
        order.append(fqn)
        seg[0] = len(order) - 1
        draws[fqn] = False
        at_entry[fqn] = torch.get_rng_state()
        if args and isinstance(args[0], torch.Tensor):
            shapes[fqn], dtypes[fqn] = tuple(args[0].shape), args[0].dtype

    def leave(blk, args, kwargs, out):
        fqn = names[id(blk)]
        draws[fqn] = not torch.equal(at_entry[fqn], torch.get_rng_state())
        first = args[0] if args else None
        same[fqn] = isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and out.shape == first.shape
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            sides[fqn] = tuple(
                (i, tuple(o.shape), o.dtype) for i, o in enumerate(out) if i > 0 and isinstance(o, torch.Tensor)
            )

    for b in blocks:
        hooks.add_hooks(b, hooks.PROBE, pre=enter, post=leave, with_kwargs=True)
    state = torch.get_rng_state()
    try:
        with torch.no_grad(), scope(on_use=on_use):
            shadow(
                *[absent.absent_like(a) for a in args], **{k: absent.absent_like(v) for k, v in (kwargs or {}).items()}
            )
        end = torch.get_rng_state()
        tail = {b: not torch.equal(s, end) for b, s in at_entry.items()}
    finally:
        torch.set_rng_state(state)
        for b in blocks:
            hooks.detach(b, hooks.PROBE)
    if not order:
        raise ConfigError(
            f"pipeline parallelism: {type(shadow).__name__} calls no @meshlm.block module in its forward; stages are "
            "cut at blocks, so mark the unit that repeats (a transformer layer) with @meshlm.block"
        )
    return Probe(order, numel, uses, draws, same, shapes, dtypes, tail, inside, sides)


@dataclass(frozen=True)
class Cut:
    """Which blocks and parameters each stage holds (NOTE [pipeline cut])."""

    stages: tuple[tuple[str, ...], ...]  # block FQNs per stage
    params: tuple[frozenset, ...]  # parameter FQNs per stage
    ranks: tuple[int, ...]  # pp rank of each stage

    def stage_of_block(self, fqn: str) -> int:
        return next(s for s, bs in enumerate(self.stages) if fqn in bs)

    def stages_on(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == rank]


def stage_ranks(n_stages: int, pp: int, style: str) -> tuple[int, ...]:
    """The pp rank of each stage: "loop" (``s % pp``) or "v" (V-shaped, two stages per rank)."""
    if style == "v":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n_stages))
    return tuple(s % pp for s in range(n_stages))


def cut(pr: Probe, n_stages: int, pp: int, style: str = "loop", split: Optional[Sequence[int]] = None) -> Cut:
    """Cut the probed model into ``n_stages`` stages over ``pp`` ranks (NOTE [pipeline cut])."""
    n = len(pr.blocks)
    if n_stages > n:
        raise ConfigError(
            f"pipeline parallelism: {n_stages} stages but the model has {n} blocks; a stage holds at least one block: "
            f"use at most {n} stages (mesh.pp x pipeline.stages_per_rank)"
        )
    of_block = {b: i for i, b in enumerate(pr.blocks)}
    cost = [0] * n
    pre = post = 0
    for fqn, segs in pr.uses.items():
        if fqn in pr.inside:
            cost[of_block[pr.inside[fqn]]] += pr.numel[fqn]
        elif PRE in segs:
            pre += pr.numel[fqn]
        elif segs and max(segs) == n - 1:
            post += pr.numel[fqn]
    if split is not None:
        counts = list(split)
        if len(counts) != n_stages or any(c < 1 for c in counts) or sum(counts) != n:
            raise ConfigError(
                f"pipeline.split={counts}: give {n_stages} block counts, each at least 1, that add up to the "
                f"model's {n} blocks"
            )
    else:
        counts = _balance(cost, n_stages, pre, post)
    stage_blocks, start = [], 0
    for c in counts:
        stage_blocks.append(tuple(pr.blocks[start : start + c]))
        start += c
    block_stage = [s for s, c in enumerate(counts) for _ in range(c)]
    params: list[set[str]] = [set() for _ in range(n_stages)]
    for fqn, segs in pr.uses.items():
        if fqn in pr.inside:
            where = {block_stage[of_block[pr.inside[fqn]]]}
        else:
            where = {0 if s == PRE else block_stage[s] for s in segs}
        if len(where) > 1:
            raise ConfigError(
                f"pipeline parallelism: parameter `{fqn}` is used by stages {sorted(where)}; each parameter must be "
                "used by one stage (a head tied to the embedding is used first and last: untie it, e.g. "
                "model.tie_embeddings=false, or use a layout without pp)"
            )
        params[where.pop() if where else n_stages - 1].add(fqn)
    return Cut(tuple(stage_blocks), tuple(frozenset(p) for p in params), stage_ranks(n_stages, pp, style))


def _balance(cost: Sequence[int], k: int, pre: int, post: int) -> list[int]:
    """Block counts of ``k`` contiguous stages minimising the largest stage's parameters
    (the pre parameters on the first stage, the post ones on the last), then, among those,
    the sum of the squares of the stages' parameters (the evenest), then the earliest split."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def stage_cost(i: int, j: int, s: int) -> int:  # blocks i..j-1 as stage s
        return prefix[j] - prefix[i] + (pre if s == 0 else 0) + (post if s == k - 1 else 0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[s][j]: first j blocks in s stages
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                c = stage_cost(i, j, s - 1)
                v = (max(best[s - 1][i][0], c), best[s - 1][i][1] + c * c)
                if v < best[s][j]:
                    best[s][j], arg[s][j] = v, i
    counts, j = [], n
    for s in range(k, 0, -1):
        i = arg[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]
