"""Activation checkpointing of ``@meshlm.block`` modules (``train.activation_checkpointing``:
``none``, ``full``, ``selective``), for ``meshlm train``, the planner's measured step and the
parity harness alike."""

from __future__ import annotations

import functools
from typing import Any

import torch


def _selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.linear.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    }
    cpu_sdpa = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_sdpa is not None:
        save.add(cpu_sdpa.default)

    def policy(ctx, op, *args, **kwargs):
        # Random ops (meshlm.dropout's key draw) are saved too: the recompute must not draw
        # again (NOTE [dropout keys] in meshlm/core/rng.py; lowering.policies.is_random).
        if op in save or torch.Tag.nondeterministic_seeded in op.tags:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Wrap each ``@meshlm.block`` module's forward in torch.utils.checkpoint (non-reentrant).
    ``full`` recomputes the whole block in backward; ``selective`` saves matmul and
    attention outputs and recomputes the cheap elementwise ops."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from meshlm.core.annotate import is_block
    from meshlm.runtime import hooks
    from meshlm.runtime.lowering import keep_constraints

    if mode == "none":
        return 0
    kw: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
    n = 0
    for m in model.modules():
        if is_block(m):
            inner = m.forward

            def fwd(*args, _inner=inner, **kwargs):
                # keep_constraints: the recompute in backward runs outside the sharded
                # forward; without it constrain() would be the identity there.
                return checkpoint(keep_constraints(_inner), *args, **kw, **kwargs)

            # _meshlm_outer_checkpoint: its recompute re-gathers (lowering.blocks.block_forward)
            hooks.set_attrs(m, hooks.CHECKPOINTING, forward=fwd, _meshlm_outer_checkpoint=True)
            n += 1
    return n
