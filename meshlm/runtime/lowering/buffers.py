"""Buffers of a sharded model: made whole on every rank, and kept equal across ranks.

NOTE [buffers]
    A buffer (``register_buffer``: a positional table, a BatchNorm's running statistics)
    has no logical axes and is never sharded: every rank holds all of it, a plain tensor
    on the mesh's device.
    - Where its values come from: a buffer the model built with values (a plain model, or
      a table computed in ``__init__`` on a real device) keeps them; a buffer on the meta
      device is filled by its module's ``init_weights(generator)``, which fills the
      module's own buffers as it fills its own parameters (``annotate.init_module`` hands
      it CPU stand-ins for both).  A meta buffer that no ``init_weights`` fills is an
      AnnotationError naming it; ``meshlm train`` avoids it by building such a model on CPU
      (NOTE [model build] in meshlm/app/model_plain.py), where ``__init__`` computes the table.
    - Used under DTensor (the DTensor root), a buffer outside local blocks is seen as a
      replicated DTensor over the buffer's own storage (``replicated``), so ``buf + x``
      and an in-place update ``buf.mul_(m).add_(stat)`` work, the statistic reduced over
      the ranks first where it is partial (a mean over sharded rows): the one-device value.
    - A forward that updates buffers (running statistics) updates each rank's copy from
      what that rank computes: under data parallelism its own rows.  After every forward
      of the sharded model, each floating buffer the forward changed (in place or by
      assignment) is averaged over all ranks of the mesh (``average_changed``), so every
      rank holds the same buffers and a checkpoint does not depend on the rank that wrote
      it.  For a statistic linear in the rows (a running mean, batches split evenly) this
      is exactly the one-device value; for others (a running variance) it is the mean of
      the ranks' statistics, as DDP's ``broadcast_buffers`` keeps rank 0's and SyncBN
      computes the global one.  Integer buffers (counters) are left as they are: every
      rank counts the same forwards.
    - Checkpoints keep the persistent buffers (``model/<fqn>``, like parameters, saved
      once) and leave out the non-persistent ones, as ``state_dict`` does
      (``persistent``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

#: (module, buffer name) of one place a buffer is registered.
Slot = tuple[nn.Module, str]


def slots(model: nn.Module) -> list[Slot]:
    """Every (module, name) that holds a buffer, each module once."""
    return [(m, n) for m in model.modules() for n, b in m._buffers.items() if b is not None]


def persistent(model: nn.Module) -> dict[str, Tensor]:
    """The buffers a checkpoint keeps, by FQN (the first name of a buffer registered twice),
    as ``state_dict`` keeps them: the non-persistent ones left out."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for mname, m in model.named_modules():
        for n, b in m._buffers.items():
            if b is None or id(b) in seen or n in m._non_persistent_buffers_set:
                continue
            seen.add(id(b))
            out[f"{mname}.{n}" if mname else n] = b
    return out


def versions(model: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """Each buffer's identity and version counter, to see which a forward changed."""
    return {(id(m), n): (id(m._buffers[n]), m._buffers[n]._version) for m, n in slots(model)}


def average_changed(model: nn.Module, mesh, before: dict) -> None:
    """Average over every rank of ``mesh`` each floating buffer that changed since
    ``before`` (``versions``); NOTE [buffers].  Collective: every rank runs the same forward,
    so every rank changes the same buffers."""
    changed: list[Tensor] = []
    for m, n in slots(model):
        b = m._buffers[n]
        if isinstance(b, DTensor):  # assigned a DTensor under the DTensor root: its whole value
            b = m._buffers[n] = b.full_tensor()
        if before.get((id(m), n)) != (id(b), b._version) and b.is_floating_point():
            changed.append(b)
    if not changed or mesh.size() == 1 or not dist.is_initialized():
        return
    with torch.no_grad():
        flat = torch.cat([b.detach().reshape(-1).float() for b in changed])
        for i in range(mesh.ndim):
            if mesh.size(i) > 1:
                dist.all_reduce(flat, group=mesh.get_group(i))
        flat /= mesh.size()
        at = 0
        for b in changed:
            b.copy_(flat[at : at + b.numel()].view_as(b))
            at += b.numel()


@contextmanager
def replicated(model: nn.Module, mesh, skip: set[int]) -> Iterator[None]:
    """Inside: every buffer of a module outside ``skip`` (ids of the modules that run on
    local tensors) is a replicated DTensor over the buffer's own storage, so in-place
    updates land in the buffer (NOTE [buffers])."""
    saved: list[tuple[nn.Module, str, Tensor, DTensor]] = []
    for m, n in slots(model):
        b = m._buffers[n]
        if id(m) in skip or isinstance(b, DTensor):
            continue
        d = DTensor.from_local(b, mesh, [Replicate()] * mesh.ndim, run_check=False)
        m._buffers[n] = d
        saved.append((m, n, b, d))
    try:
        yield
    finally:
        for m, n, b, d in saved:
            if m._buffers.get(n) is d:
                m._buffers[n] = b
