"""The float32 recipe of ``check_training`` and the step helpers every recipe shares
(``harness.parity``, ``harness.parity_mp``)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from harness import tolerances as tol
from meshlm import _torch_compat as compat


def full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


# NOTE [gathered at once]: the harness compares whole tensors, so it gathers every parameter,
# gradient, master and optimizer state of every step.  One ``full_tensor`` each is one or two
# collectives each, and a gloo collective among 4 processes on 2 loaded CPU cores costs about
# 6 ms whatever its size (1.6 ms among 2): those gathers were most of a 4-process parity
# case's time.  ``full_many`` gathers a whole set in two collectives (the pieces' keys, offsets
# and shapes by ``all_gather_object``, their bytes as one flat buffer by ``all_gather``: pickling
# the tensors themselves took 0.6 s of a 1.7 s fsdp=2 case): each rank sends its shard of every DTensor split by plain ``Shard`` (``Replicate`` besides)
# on a mesh of the whole world, with the shard's offset in the global tensor; every rank
# pastes the shards into place.  Copies only, so bit for bit what ``full_tensor`` gives (a
# test checks it); anything else (``Partial``, strided shards, a submesh, no process group)
# goes through ``full`` one by one.


def _pasted(t: Tensor) -> bool:
    """Whether ``full_many`` gathers ``t`` by pasting shards (NOTE [gathered at once])."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(t, DTensor) or not dist.is_initialized():
        return False
    kinds = [type(p) for p in t.placements]
    return (
        Shard in kinds and all(k in (Shard, Replicate) for k in kinds) and t.device_mesh.size() == dist.get_world_size()
    )


def full_many(ts: dict) -> dict:
    """``{k: full(t)}`` for a dict of tensors (or None), in two collectives for all the
    DTensors it can paste together (NOTE [gathered at once]).  Every rank must call it with
    the same keys, in the same order, as with ``full``."""

    from meshlm import _torch_compat as compat

    out, mine = {}, []
    for k, t in ts.items():
        if t is not None and _pasted(t):
            mine.append((k, compat.local_offset(t), t.to_local().detach()))
        else:
            out[k] = full(t)
    if mine:
        for k, shards in _gather_pieces(mine).items():
            out[k] = torch.empty(ts[k].shape, dtype=shards[0][1].dtype)
            for off, piece in shards:
                out[k][tuple(slice(o, o + n) for o, n in zip(off, piece.shape))] = piece
    return {k: out[k] for k in ts}


def _gather_pieces(mine: list) -> dict:
    """Every rank's ``(key, offset, local)`` pieces, by key: ``[(offset, piece), ...]``.  The
    pieces travel as the bytes of one flat buffer per rank in one all-gather (pickling each
    tensor, as ``all_gather_object`` does, cost more than the step it checked); only their
    keys, offsets, shapes and dtypes are pickled."""
    import torch.distributed as dist

    flat = [t.contiguous().reshape(-1).view(torch.uint8) for _, _, t in mine]
    meta = [(k, off, tuple(t.shape), t.dtype, f.numel()) for (k, off, t), f in zip(mine, flat)]
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta)
    size = max(sum(m[-1] for m in ms) for ms in metas)
    buf = torch.zeros(size, dtype=torch.uint8)
    mine_bytes = torch.cat(flat) if flat else buf[:0]
    buf[: mine_bytes.numel()] = mine_bytes
    bufs = [torch.empty_like(buf) for _ in metas]
    dist.all_gather(bufs, buf)
    out: dict = {}
    for ms, b in zip(metas, bufs):
        at = 0
        for k, off, shape, dtype, n in ms:
            out.setdefault(k, []).append((off, b[at : at + n].clone().view(dtype).reshape(shape)))  # aligned
            at += n
    return out


def forward_seed(seed: int, step: int, micro: int) -> int:
    return 7919 * seed + 1000 * step + micro


def accumulate(model: nn.Module, micro_batches: list, grad_accum: int, seed: int, step: int) -> list[Tensor]:
    """Forward of each micro-batch, then the backward of each loss times its share of the
    step's total weight (``step_weight``): the gradients of the step's whole batch as one
    device computes it."""
    outs = forwards(model, micro_batches, seed, step)
    for loss, share in outs:
        (loss * share).backward()
    return [full(loss) for loss, _share in outs]


def forwards(model: nn.Module, micro_batches: list, seed: int, step: int) -> list[tuple[Tensor, float]]:
    """Each micro-batch's loss (its graph kept) and its share of the step's total weight."""
    losses = []
    for j, (args, kwargs) in enumerate(micro_batches):
        torch.manual_seed(forward_seed(seed, step, j))
        losses.append(model(*args, **kwargs))
    weights = [step_weight(x) for x in losses]
    total = sum(weights)
    return [(x, w / total if total > 0 else 0.0) for x, w in zip(losses, weights)]


def step_weight(loss: Tensor) -> float:
    """The weight of a micro-batch's loss in the whole step's mean, as one device computes
    it: torch's own total weight of a mean ``F.cross_entropy`` / ``F.nll_loss`` (saved on
    its autograd node: the count of targets not ignored), the ``weight`` a model declared
    through ``meshlm.reduce_batch`` (on one device meshlm only records it), else 1 (a plain
    mean of equal micro-batches)."""
    w = getattr(loss, "_meshlm_weight", None)
    nll = compat.nll_node_fields(loss.grad_fn)  # torch's node, read through the compat wrapper
    if w is None and nll is not None and nll[0] == 1:
        w = nll[1]
    return 1.0 if w is None else float(w)


class FP32:
    """The float32 recipe: the model as built, float32 throughout; one-step tolerances of
    float32 summation order (``tolerances.LOSS_RTOL``, ``grad_tol``).  The interface of a
    recipe (``parity_mp.BF16`` is the other one)."""

    grad_dtype: torch.dtype | None = None  # the dtype every gradient must reach backward's end in (None: any)

    def shard_dtypes(self, layout: str, mesh, compile: str | None, comms: str) -> dict:
        """``meshlm.shard`` dtype arguments of the sharded model."""
        return {}

    def accumulate(self, model: nn.Module, micro: list, grad_accum: int, seed: int, step: int) -> list[Tensor]:
        """One step's micro-batches through a plain torch model: the losses; the accumulated
        gradients in its parameters' ``.grad``."""
        return accumulate(model, micro, grad_accum, seed, step)

    def probe_weights(self, model: nn.Module, opt) -> dict[str, Tensor]:
        """The weights (gathered, as the probe's float32 parameters) the sharded model steps from."""
        return full_many(dict(model.named_parameters()))

    @contextlib.contextmanager
    def watching(self, mesh, what: str):
        """Around a step's forwards, backwards and gradient reduction, which it may check;
        gives a context to enter around the reduction at the step."""
        yield contextlib.nullcontext

    def tolerances(
        self, job, weights: dict, micro: list, losses: list, grads: dict, seed: int, step: int
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """The one-step tolerances (per micro-batch loss, per parameter gradient) at the
        probe's ``weights``, given the probe's ``losses`` and ``grads``."""
        have = {n: g for n, g in grads.items() if g is not None}  # none: a parameter the step did not use
        floor = tol.grad_noise_floor(have.values())
        return [tol.LOSS_RTOL * x.abs() for x in losses], {n: tol.grad_tol(g, floor) for n, g in have.items()}
