"""The collectives of one training step, predicted parameter by parameter from the
lowering's plans (NOTE [plan = lowering]), and the textbook volumes beside them."""

from __future__ import annotations

import math
from typing import Any

from meshlm.core.axes import DATA_AXES
from meshlm.plan.cp import CP, attention_comm, cp_degree
from meshlm.plan.report import CommEntry
from meshlm.plan.state import _dimplan_axes, _local_numel, _prod
from meshlm.runtime.comm import ring_factor
from meshlm.runtime.lowering.params import pure_data_parallel
from meshlm.runtime.optim.chunks import outside_chunks


def _comm(cfg, lay, sizes, params_, b, s, nbytes, batch_axes, accum, ac) -> list[CommEntry]:
    """``ac``: ``train.activation_checkpointing``.  ``nbytes``: element bytes of the storage, compute, reduce and master dtypes: gathers
    move the compute dtype (cast before the gather), gradient reductions the reduce dtype
    (the master's at the optimizer step, ZeRO-1), the optimizer's all-gather the storage."""
    B, CB, RB, MB = nbytes
    mixed = MB != B
    out: dict[tuple, CommEntry] = {}
    flat: set[tuple] = set()

    def add(kind, axis, phase, nbytes, what, count=1, bucket=None):
        """``bucket``: the parameter is in a block's bucket (NOTE [block buckets] in
        meshlm/runtime/bucket), and ``bucket`` names its flat collective: every parameter with the same
        one shares a single collective per block, so only the first counts it (``count``
        times, once per block)."""
        n = sizes[axis]
        key = (kind, (axis,), phase, what)
        e = out.get(key)
        if e is None:
            e = out[key] = CommEntry(kind, (axis,), phase, 0, 0, 0.0, what)
        if bucket is None or (key, bucket) not in flat:
            e.count += count
            if bucket is not None:
                flat.add((key, bucket))
        e.bytes += int(nbytes) * count
        e.wire_bytes += nbytes * ring_factor(kind, n) * count

    data_batch = [a for a in batch_axes if a in DATA_AXES]
    data_active = [a for a in DATA_AXES if sizes.get(a, 1) > 1]
    # NOTE [local root] in lowering/local_root.py: under pure data parallelism the root runs on local
    # tensors; its parameters that compute uses as stored share one flat gradient
    # reduction, and the loss is combined from (loss x weight, weight).
    local_root = bool(data_active) and pure_data_parallel(lay, sizes)
    outside = _outside_chunks(params_)
    # sequence parallelism's axes (the norms see seq-sharded input), and context parallelism's
    # (every parameter sees this rank's tokens only: NOTE [planned cp] in meshlm/plan/cp.py)
    seq_axes = [a for a in lay.compute.get("seq", ()) if sizes.get(a, 1) > 1 and a != CP]
    ctx_axes = [CP] if cp_degree(lay, sizes) > 1 else []
    for prm in params_:
        pp, k = prm.plan, prm.count
        # at-use gather: storage axes that compute drops, inner axis first
        cur = _local_numel(pp, pp.storage, sizes)
        gathers = []
        for st_axes, cp_axes in zip(pp.storage, pp.compute):
            for ax in reversed(st_axes):
                if ax not in cp_axes and sizes.get(ax, 1) > 1:
                    cur *= sizes[ax]
                    gathers.append((ax, cur))
        regather = prm.in_block and any(a in DATA_AXES for a, _ in gathers)
        # bucketed: a block parameter moved to compute by gathers over data axes only, on a
        # mesh with a data axis or cp (lowering/blocks.py block_spec; NOTE [cp gradients in
        # buckets] in meshlm/runtime/bucket/__init__.py)
        member = prm.in_block and bool(data_active or ctx_axes) and all(a in DATA_AXES for a, _ in gathers)
        for ax, nb in gathers:
            add(
                "all_gather",
                ax,
                "forward",
                nb * CB,
                "param gather at use",
                accum * k,
                bucket="gather" if member else None,
            )
            if regather:
                add(
                    "all_gather",
                    ax,
                    "backward",
                    nb * CB,
                    "param re-gather in backward (ZeRO-3)",
                    accum * k,
                    bucket="gather" if member else None,
                )
        # Gradient reduction (lowering/atuse.py AtUse.backward): the gradient is Partial over each
        # data axis that splits the batch but not the parameter, and, under sequence
        # parallelism, over the seq axes for the norm weights (the only parameters used on
        # the seq-sharded residual stream).  It is reduce-scattered first over the axes its
        # grads placement shards (mesh order), then all-reduced over the rest, on the shard.
        gplan = pp.grads
        target = gplan if gplan is not None else pp.optimizer
        phase = "backward" if gplan is not None else "optimizer"
        cnt = (accum if gplan is not None else 1) * k
        gaxes, caxes = _dimplan_axes(target), _dimplan_axes(pp.compute)
        partial = [ax for ax in data_batch if ax not in caxes]
        if pp.axes == ("embed",):
            partial += [ax for ax in seq_axes if ax not in caxes]
        partial += [ax for ax in ctx_axes if ax not in caxes]
        # In a bucket, gradients that go through the same reductions share them (meshlm/runtime/bucket).
        route = (tuple(ax for ax in partial if ax in gaxes), tuple(ax for ax in partial if ax not in gaxes))
        # the optimizer's collectives are flat per block, and per chunk of the parameters
        # outside blocks (NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py)
        root_member = local_root and not prm.in_block and not gathers
        chunk = "optimizer" if prm.in_block else ("optimizer", outside[id(prm)])
        rb = route if member and phase == "backward" else (chunk if phase == "optimizer" else None)
        if root_member and phase == "backward":
            rb = ("root", route)
        cur = _local_numel(pp, pp.compute, sizes)
        GB = RB if phase == "backward" else MB  # ZeRO-1 reduces the master's dtype at the step
        for ax in partial:
            if ax in gaxes:
                add("reduce_scatter", ax, phase, cur * GB, "gradient reduce-scatter", cnt, bucket=rb)
                cur //= sizes[ax]
        for ax in partial:
            if ax not in gaxes:
                what = (
                    "gradient all-reduce"
                    if ax in DATA_AXES
                    else ("cp: gradient all-reduce" if ax == CP else "SP: norm weight grads (seq-sharded inputs)")
                )
                add("all_reduce", ax, "backward" if ax not in DATA_AXES else phase, cur * GB, what, cnt, bucket=rb)
        # optimizer: refresh the stored parameter from its (sharded) master
        direct = pp.optimizer == pp.storage and gplan is not None and gplan == pp.optimizer and not mixed
        if not direct:
            cur = _local_numel(pp, pp.optimizer, sizes)
            for o_axes, s_axes in zip(pp.optimizer, pp.storage):
                for ax in reversed(o_axes):
                    if ax not in s_axes and sizes.get(ax, 1) > 1:
                        cur *= sizes[ax]
                        add(
                            "all_gather",
                            ax,
                            "optimizer",
                            cur * B,
                            "updated shard all-gather (ZeRO-1/2)",
                            k,
                            bucket=chunk,
                        )
    # the scalar loss: a mean over the batch shards, one all-reduce per data mesh dim (of
    # the loss and its weight under a local root)
    for ax in [*data_batch, *ctx_axes]:
        add("all_reduce", ax, "forward", 8 if local_root else 4, "scalar loss", accum)
    # which parameters some rank used, under a local root: a byte per parameter, one
    # all-reduce per data mesh dim at the step (NOTE [unused parameters] in meshlm/runtime/unused.py)
    if local_root:
        for ax in data_active:
            add("all_reduce", ax, "optimizer", sum(prm.count for prm in params_), "used-parameter flags")
    ckpt = ac != "none"
    _activation_comm(cfg, lay, sizes, b, s // cp_degree(lay, sizes), CB, add, accum, ckpt)
    attention_comm(cfg, lay, sizes, b, s, CB, add, accum, ac)
    return list(out.values())


def _outside_chunks(params_) -> dict[int, int]:
    """The optimizer chunk of each parameter outside the blocks (optim.outside_chunks, capped
    at one block's bytes, as ``ShardedOptimizer`` chunks them)."""

    def nbytes(prm):
        return math.prod(prm.plan.shape) * prm.plan.dtype.itemsize

    outside = [prm for prm in params_ if not prm.in_block]
    cap = sum(nbytes(prm) for prm in params_ if prm.in_block)
    return {id(prm): g for prm, g in zip(outside, outside_chunks([nbytes(prm) for prm in outside], cap))}


def _activation_comm(cfg, lay, sizes, b, s, B, add, accum, ckpt) -> None:
    """Megatron TP / TP+SP activation collectives over the tensor axis (tests/dist/test_budget.py
    derives the same counts); ``s``: this rank's tokens of a sequence (s/cp under cp)."""
    tp_axes = [a for a in lay.compute.get("heads", ()) if sizes.get(a, 1) > 1]
    if not tp_axes:
        return
    ax = tp_axes[0]
    L = cfg.layers
    bsh = b * s * cfg.embed * B
    sp = any(sizes.get(a, 1) > 1 and a != CP for a in lay.compute.get("seq", ()))
    vocab_par = any(sizes.get(a, 1) > 1 for a in lay.compute.get("vocab", ()))
    n = accum
    if not sp:
        add("all_reduce", ax, "forward", bsh, "Megatron TP: attention and MLP outputs", 2 * L * n)
        add("all_reduce", ax, "backward", bsh, "Megatron TP: attention and MLP input grads", 2 * L * n)
        if vocab_par:
            add("all_reduce", ax, "forward", bsh, "vocab-parallel embedding output", n)
            add("all_reduce", ax, "backward", bsh, "vocab-parallel head: input grad", n)
        if ckpt:
            add("all_reduce", ax, "backward", bsh, "recompute: attention output (checkpointed block)", L * n)
    else:
        add("all_gather", ax, "forward", bsh, "TP+SP: block inputs gathered", 2 * L * n)
        add("reduce_scatter", ax, "forward", bsh, "TP+SP: block outputs reduce-scattered", 2 * L * n)
        add("all_gather", ax, "backward", bsh, "TP+SP: output grads gathered", 2 * L * n)
        add("reduce_scatter", ax, "backward", bsh, "TP+SP: input grads reduce-scattered", 2 * L * n)
        add("all_gather", ax, "forward", bsh, "TP+SP: output head input gathered", n)
        add("all_gather", ax, "backward", bsh, "TP+SP: embedding output grad gathered", n)
        if vocab_par:
            add("reduce_scatter", ax, "forward", bsh, "vocab-parallel embedding output", n)
            add("reduce_scatter", ax, "backward", bsh, "vocab-parallel head: input grad", n)
        if ckpt:
            add(
                "all_gather", ax, "backward", bsh, "recompute: attention and MLP inputs (checkpointed block)", 2 * L * n
            )
            add("reduce_scatter", ax, "backward", bsh, "recompute: attention output (checkpointed block)", L * n)


def _comm_formula(lay, cfg, psi, sizes, b, s, nbytes, batch_axes) -> dict[str, Any]:
    """``nbytes``: element bytes of the storage, compute and reduce dtypes."""
    B, CB, RB = nbytes
    out: dict[str, Any] = {}
    data = [a for a in batch_axes if a in DATA_AXES]
    n = _prod(data, sizes)
    t = sizes.get("tp", 1)
    if n > 1:
        stage3 = any(a in DATA_AXES for v in lay.params.values() for a in v)
        k = 3 if stage3 else 2
        # ZeRO-3: two gathers in the compute dtype + a reduce-scatter in the reduce dtype;
        # DDP: an all-reduce (reduce-scatter + all-gather) in the reduce dtype; ZeRO-1/2: a
        # reduce-scatter in the reduce dtype + an all-gather of the stored parameters.
        per = 2 * CB + RB if stage3 else RB + (RB if lay.name == "ddp" else B)
        terms = f"2·{CB}+{RB}" if stage3 else f"{RB}+{RB if lay.name == 'ddp' else B}"
        out["data"] = {
            "wire_bytes": (n - 1) / n * psi / t * per,
            "text": f"{k}(N-1)/N·Ψ·B/t, here (N-1)/N·Ψ/t·({terms} bytes) with N={n}, t={t} "
            f"({'ZeRO-3: gathers + reduce-scatter' if stage3 else 'DDP/ZeRO-1/2'})",
        }
    if t > 1:
        out["tp"] = {
            "wire_bytes": 4 * 2 * (t - 1) / t * b * s * cfg.embed * CB * cfg.layers,
            "text": f"4·2(t-1)/t·bsh·B per layer × L={cfg.layers} (TP and TP+SP alike)",
        }
    return out
