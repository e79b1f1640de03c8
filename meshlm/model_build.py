"""Building the sharded model a run trains, from the model node or from Hugging Face weights.

Its own module because it sits above both: ``meshlm.hf`` imports the checkpoint module,
which imports the config, which imports ``meshlm.model_config``; building in
``model_config`` would import ``hf`` back up that chain (tests/unit/test_imports.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshlm.lowering import shard
from meshlm.model_config import ModelConfig, build_model


def build_sharded(
    cfg: ModelConfig, layout: Any, mesh: Any, *, seed: int = 0, after_block: Any = None, **shard_kwargs: Any
) -> nn.Module:
    """The model of ``cfg`` sharded under ``layout`` on ``mesh``: built on the meta device
    and initialised from ``seed`` shard by shard, or, with ``init_from``, the Hugging Face
    model in that directory (its ``config.json`` gives the architecture) with its weights.
    ``after_block``: ``meshlm.shard``'s (with ``init_from``, called once the block's weights
    are read too)."""
    if cfg.init_from:
        from meshlm.hf import load_hf

        return load_hf(cfg.init_from, layout, mesh, after_block=after_block, **shard_kwargs)
    return shard(build_model(cfg, "meta"), layout, mesh, seed=seed, after_block=after_block, **shard_kwargs)


def build_pipelined(cfg, mcfg: ModelConfig, layout: Any, device_type: str, *, seed: int = 0, **shard_kwargs: Any):
    """The run's model as a pipeline over ``mesh.pp`` (a layout with ``layers: pp``; NOTE
    [pipelined step] in meshlm/pipeline/pipe.py): this rank's ``Pipeline``, its stages'
    parameters sharded on the mesh without pp, ``train.grad_accum`` micro-batches a step."""
    import torch

    from meshlm.errors import ConfigError
    from meshlm.model_config import loss_of
    from meshlm.pipeline import build_pipeline, pipeline_mesh

    if mcfg.init_from:
        raise ConfigError(
            f"model.init_from={mcfg.init_from} with pipeline layout {layout.name}: loading Hugging Face weights "
            "into pipeline stages is not supported yet; convert them to a meshlm checkpoint first (meshlm "
            "convert, docs/checkpoint.md) and resume from it (checkpoint.resume=PATH), which any layout loads"
        )
    t, p = cfg.train, cfg.pipeline
    mesh, sub = pipeline_mesh(cfg.mesh.as_dict(), device_type)
    micro = torch.zeros(t.batch_size // t.grad_accum, t.seq_len, dtype=torch.long)
    return build_pipeline(
        lambda device: build_model(mcfg, device),
        layout,
        mesh,
        sub,
        example=((micro, micro), {}),
        microbatches=t.grad_accum,
        schedule=p.schedule,
        stages_per_rank=p.stages_per_rank,
        split=p.split,
        regather=p.regather,
        pick_loss=lambda out: loss_of(out, cfg.model),
        seed=seed,
        **shard_kwargs,
    )
