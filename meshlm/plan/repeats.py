"""Measure a model of many identical blocks by measuring a few of them and counting the rest.

NOTE [counted blocks]
    A fake step costs time per op (DTensor's dispatch, the planner's dispatch modes), so a
    model's 32 or 126 identical blocks cost 32 or 126 times one.  Every figure the planner
    measures is a sum over the step's ops: model state and held storage per parameter and
    per op, collectives per (kind, mesh axes, phase), FLOPs; and the peak is the storage
    alive at one point of the step, model state and held activations included, each block
    adding its own.  So for a list of ``n`` identical blocks (``@meshlm.block`` modules of
    one class, with equal parameter and buffer shapes, none shared with the rest of the
    model), a figure is ``f(2) + (n - 2)·(f(3) - f(2))``: the step measured with the list
    cut to its first two blocks (the first and the last, which differ from the middle: the
    first gathers ahead, the last is the first in backward) and to its first three (one
    middle block more).  A model with several such lists (a vision tower and a text
    decoder) is measured once with every list at two and once more per list with that
    list at three.  ``f(3) - f(2)`` is the one place a block's increment is computed: the
    activations it holds, its parameter copies, its collectives and FLOPs (a parallelism
    added later adds its terms there without a change here).

    The planner counts blocks so only where it is exact in kind: lists of at least
    ``MIN_BLOCKS``, no pipeline (stages cut the list), no scopes or offload (their
    figures are kept per module).  ``tests/fake/test_plan_counted.py`` holds the counted
    figures to the fully measured ones, every field, for one layout of each kind, and
    ``benchmarks/plan_counted_sweep.py`` for each shipped layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from meshlm.core.annotate import is_block

#: a list shorter than this is measured whole (counting measures 2 + 3 blocks)
MIN_BLOCKS = 6


@dataclass(frozen=True)
class Repeats:
    """A list of identical blocks: its path in the model and its length."""

    path: str
    n: int


def _signature(m: torch.nn.Module) -> tuple:
    return (
        type(m),
        tuple((k, tuple(p.shape), p.dtype) for k, p in m.named_parameters()),
        tuple((k, tuple(b.shape), b.dtype) for k, b in m.named_buffers()),
    )


def repeats(model: torch.nn.Module) -> list[Repeats]:
    """The model's lists of at least ``MIN_BLOCKS`` identical blocks (NOTE [counted blocks])."""
    owners: dict[int, int] = {}  # parameter -> how many module paths hold it
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for path, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) or len(m) < MIN_BLOCKS:
            continue
        kids = list(m)
        if not all(is_block(k) for k in kids) or len({_signature(k) for k in kids}) != 1:
            continue
        if any(owners[id(p)] > 1 for k in kids for _, p in k.named_parameters(remove_duplicate=False)):
            continue  # a parameter shared across blocks is not one block's to count
        out.append(Repeats(path, len(kids)))
    return out


def cut(build: Callable[[str], torch.nn.Module], keep: dict[str, int]) -> Callable[[str], torch.nn.Module]:
    """``build`` whose lists at ``keep``'s paths keep only their first ``keep[path]`` blocks."""

    def built(device: str) -> torch.nn.Module:
        model = build(device)
        for path, k in keep.items():
            del model.get_submodule(path)[k:]
        return model

    return built


def count(base: dict, more: list[tuple[dict, int]]):
    """``base`` (every list at two blocks) plus, per list, ``(n - 2)`` times what one block
    more added (``more``: the figures with that list at three, and ``n - 2``).  Figures are
    nested dicts of numbers; a key one measurement lacks counts as 0."""

    def add(a, b, k: int):
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            return {key: add(a.get(key), b.get(key), k) for key in {**a, **b}}
        return (a or 0) + k * (b or 0)

    out = base
    for fig, times in more:
        step = add(fig, base, -1)  # one block's increment
        out = add(out, step, times)
    return out
