"""Plain models: built whole on the host from ``train.seed``, then sharded.

NOTE [model build]
    ``meshlm train`` builds the model node on the meta device first (no memory).  If every
    module that owns parameters or buffers defines ``init_weights(generator)``, that model is
    sharded and initialised shard by shard from ``train.seed`` (``meshlm.shard``): any size.
    Otherwise it is a *plain* model (nanoGPT, a Hugging Face module, a model of your own
    that makes its weights in ``__init__``), and it is built again for real, on CPU, under
    ``torch.manual_seed(train.seed)``: exactly the weights and buffers that
    ``torch.manual_seed(seed); Model(**kw)`` gives on one device.  Each rank slices its
    shards out of that copy and drops it (``meshlm.shard`` of a model holding real
    weights); the ranks of one host take turns (by local rank, a barrier between turns), so
    a host holds one full copy at a time while building.  The run's final line says which
    build ran and the bytes of the whole copy.

    Too large to build: the meta model's bytes (parameters and buffers) more than the
    host's available memory (``MemAvailable``), or the build running out of memory, stop
    the run on every rank with an AnnotationError that names the modules lacking
    ``init_weights``: defining it is the way past host memory.  A model the meta device
    cannot build (its ``__init__`` reads values) is built on CPU with no size check.
    The global RNG is left as it was (``fork_rng``), so the run's own stream (dropout, data
    order) does not depend on which build ran.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from meshlm.core.errors import AnnotationError


def lacking_init(model: nn.Module) -> list[str]:
    """Paths of the modules that first register a parameter or a buffer (a tied one counts
    at its first slot, as ``meshlm.shard`` initialises it) but define no ``init_weights``
    (``"model"`` for the root); empty: the model initialises shard by shard."""
    out, seen = [], set()
    for path, m in model.named_modules():
        first = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None and id(t) not in seen]
        seen.update(id(t) for t in first)
        if first and not callable(getattr(m, "init_weights", None)):
            out.append(path or "model")
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor once."""
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def available_host_bytes() -> Optional[int]:
    """The host's available memory (``MemAvailable`` of /proc/meminfo), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def too_large(label: str, need: Optional[int], have: Optional[int], lacking: list[str], why: str = "") -> str:
    """The error for a plain model that does not fit in host memory (NOTE [model build])."""
    mods = ", ".join(f"`{p}`" for p in lacking[:5]) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
    size = f" ({need / 2**30:.2f} GiB of parameters and buffers" if need is not None else ""
    size += f", {have / 2**30:.2f} GiB available on this host)" if have is not None and size else (")" if size else "")
    return (
        f"model {label}{size} is too large to build whole on the host{why}: it has modules without "
        f"init_weights(generator) ({mods}), so meshlm builds it on CPU from train.seed before sharding it. "
        "Define init_weights(generator) on each of them, filling that module's own parameters and buffers: "
        "the model is then built on the meta device and initialised shard by shard, at any size "
        '(docs/train.md, "Your own model").'
    )


def build_on_host(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` on CPU under ``torch.manual_seed(seed)``, the global RNG left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def in_turns(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` run by the ranks of each host one at a time (by local rank), so that a host
    holds one whole copy of the model at a time; an error on any rank is raised on every
    rank after the last turn (its own where it failed), never left as a hang."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    model, err = None, None
    for turn in range(local_world):
        if turn == local_rank:
            try:
                model = make()
            except Exception as e:  # noqa: BLE001 - raised below, once every rank has had its turn
                err = e
        dist.barrier()
    errors: list = [None] * world
    dist.all_gather_object(errors, None if err is None else f"{type(err).__name__}: {err}")
    if err is not None:
        raise err
    failed = next((e for e in errors if e), None)
    if failed is not None:
        raise AnnotationError(f"building the model failed on another rank: {failed}")
    assert model is not None
    return model


def is_oom(e: BaseException) -> bool:
    """A host allocation that failed."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e).lower())
