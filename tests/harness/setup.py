"""The sharded llama_tiny + AdamW + one batch that budget, plan and fake tests step."""

from __future__ import annotations

import torch


def tiny_sharded(layout: str, mesh_shape, *, batch: int, seq: int, fake: bool = False, **shard_kw):
    """(mesh, model, optimizer, inputs, labels): llama_tiny sharded under ``layout`` from
    seed 0 and this rank's slices of a fixed global batch of ``batch`` x ``seq`` tokens."""
    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh(mesh_shape, fake=fake)
    cfg = llama_config("llama_tiny")
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, **shard_kw)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    toks = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x = meshlm.shard_batch(toks[:, :-1], layout, mesh)
    y = meshlm.shard_batch(toks[:, 1:], layout, mesh)
    return mesh, model, opt, x, y


def accumulation_batches(vocab: int, steps: int, accum: int, seed: int, shape=(4, 16)) -> list:
    """``steps`` lists of ``accum`` (tokens, labels) micro-batches of random ids below
    ``vocab``, from a generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(accum)
        ]
        for _ in range(steps)
    ]
