"""One iteration of the scheduler as data (:class:`Plan`), and the forwards it makes
(:class:`Runner`): the same on every rank of a layout over several processes, where rank 0's
scheduler broadcasts each plan and the other ranks :func:`follow` it (NOTE [continuous
batching] in meshlm/infer/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm.infer.generate import _device
from meshlm.infer.slots import SlotCache


@dataclass
class Plan:
    """What one iteration runs: the slots freed before it, a prefill forward (slot, the
    prompt tokens of this chunk) and a decode forward (slot, the token it feeds)."""

    free: list[int] = field(default_factory=list)
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    decode: list[tuple[int, int]] = field(default_factory=list)


class Runner:
    """The model and its :class:`SlotCache` of ``slots`` rows of ``context`` positions."""

    def __init__(self, model: nn.Module, slots: int, context: int, pad: int = 0):
        self.model, self.pad = model, pad
        self.device = _device(model)
        self.cache = SlotCache(slots, context, device=self.device)
        self.forwards = 0

    @torch.no_grad()
    def run(self, plan: Plan) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The last position's logits (rows, vocab), float on the CPU, of the prefill rows
        and of the decode rows (None where that forward is empty)."""
        for s in plan.free:
            self.cache.free(s)
        was = self.model.training
        self.model.eval()
        try:
            pre = None
            if plan.prefill:
                width = max(len(ids) for _, ids in plan.prefill)
                tokens = torch.full((len(plan.prefill), width), self.pad, dtype=torch.long)
                for b, (_, ids) in enumerate(plan.prefill):
                    tokens[b, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
                pre = self._forward([s for s, _ in plan.prefill], [len(ids) for _, ids in plan.prefill], tokens)
            dec = None
            if plan.decode:
                tokens = torch.tensor([[t] for _, t in plan.decode], dtype=torch.long)
                dec = self._forward([s for s, _ in plan.decode], [1] * len(plan.decode), tokens)
        finally:
            self.model.train(was)
        return pre, dec

    def _forward(self, rows: list[int], new: list[int], tokens: Tensor) -> Tensor:
        self.cache.begin(rows, new, tokens.shape[1])
        try:
            out = self.model(tokens.to(self.device), cache=self.cache)
        except BaseException:
            self.cache.abort()
            raise
        self.cache.end()
        self.forwards += 1
        last = out[:, -1]
        last = last.full_tensor() if isinstance(last, DTensor) else last
        return last.float().cpu()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(runner: Runner) -> None:
    """A rank other than 0: run every plan rank 0 broadcasts, until it broadcasts None."""
    while True:
        plan = broadcast(None)
        if plan is None:
            return
        try:
            runner.run(plan)
        except Exception:  # noqa: BLE001 - rank 0 failed the same forward and fails its requests
            pass
