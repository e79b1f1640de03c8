"""Building the sharded model a run trains, from the model node or from Hugging Face weights.

Its own module because it sits above both: ``meshlm.hf`` imports the checkpoint module,
which imports the config, which imports ``meshlm.model_config``; building in
``model_config`` would import ``hf`` back up that chain (tests/unit/test_imports.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshlm.lowering import shard
from meshlm.model_config import ModelConfig, build_model


def build_sharded(cfg: ModelConfig, layout: Any, mesh: Any, *, seed: int = 0, **shard_kwargs: Any) -> nn.Module:
    """The model of ``cfg`` sharded under ``layout`` on ``mesh``: built on the meta device
    and initialised from ``seed`` shard by shard, or, with ``init_from``, the Hugging Face
    model in that directory (its ``config.json`` gives the architecture) with its weights."""
    if cfg.init_from:
        from meshlm.hf import load_hf

        return load_hf(cfg.init_from, layout, mesh, **shard_kwargs)
    return shard(build_model(cfg, "meta"), layout, mesh, seed=seed, **shard_kwargs)
