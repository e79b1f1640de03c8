"""Building the sharded model a run trains, from the model node (:func:`build_model`, with
Hydra's ``instantiate``) or from Hugging Face weights.

Its own module because it sits above both: ``meshlm.interop.hf`` imports the checkpoint module,
which imports the config, which imports ``meshlm.models.node``; building in
``model_config`` would import ``hf`` back up that chain (tests/unit/test_imports.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from meshlm.app import model_plain
from meshlm.core.errors import AnnotationError, ConfigError
from meshlm.models.node import ModelConfig, check_args, locate, takes_device, target_signature
from meshlm.runtime.lowering import shard


def build_model(cfg: ModelConfig, device: "str | torch.device" = "meta") -> nn.Module:
    """Instantiate the model node on ``device`` (NOTE [model node] in meshlm/models/node.py) and
    check that it is an ``nn.Module``.  What ``meshlm train``, ``meshlm plan`` and ``meshlm
    layout show`` build; for your own tools too."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_args(cfg)
    fn = locate(cfg)
    node = {"_target_": cfg.target, "_convert_": "all", **cfg.args}
    kw = {"device": device} if takes_device(target_signature(fn)) else {}
    try:
        with torch.device(device):
            model = instantiate(node, **kw)
    except InstantiationException as e:
        if e.__cause__ is not None:  # the target's own error, with its traceback
            raise e.__cause__ from None
        raise ConfigError(f"model._target_={cfg.target}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={cfg.target} returned a {type(model).__name__}, not a torch.nn.Module; "
            "point _target_ at the model class or at a function that returns the model"
        )
    return model


def build_sharded(
    cfg: ModelConfig, layout: Any, mesh: Any, *, seed: int = 0, after_block: Any = None, **shard_kwargs: Any
) -> nn.Module:
    """The model of ``cfg`` sharded under ``layout`` on ``mesh``: built on the meta device
    and initialised from ``seed`` shard by shard, or, for a plain model (a module without
    ``init_weights``), built whole on CPU from ``seed`` and sliced (NOTE [model build] in
    meshlm/app/model_plain.py); or, with ``init_from``, the Hugging Face model in that directory
    (its ``config.json`` gives the architecture) with its weights.  ``after_block``:
    ``meshlm.shard``'s (with ``init_from``, called once the block's weights are read too).
    The model's ``_meshlm_build`` says which build ran (``how``) and the whole model's
    bytes (``bytes``)."""
    if cfg.init_from:
        from meshlm.interop.hf import load_hf

        model = load_hf(cfg.init_from, layout, mesh, after_block=after_block, **shard_kwargs)
        model._meshlm_build = {"how": "init_from", "bytes": None}
        return model
    try:
        meta: Optional[nn.Module] = build_model(cfg, "meta")
    except (NotImplementedError, RuntimeError):  # an __init__ that reads values: build it for real
        meta = None
    lacking = ["model"] if meta is None else model_plain.lacking_init(meta)
    if meta is not None and not lacking:
        model = shard(meta, layout, mesh, seed=seed, after_block=after_block, **shard_kwargs)
        model._meshlm_build = {"how": "meta", "bytes": model_plain.model_bytes(model)}
        return model
    need = None if meta is None else model_plain.model_bytes(meta)
    del meta

    def make() -> nn.Module:
        have = model_plain.available_host_bytes()
        if need is not None and have is not None and need > have:
            raise AnnotationError(model_plain.too_large(cfg.label, need, have, lacking))
        try:
            whole = model_plain.build_on_host(lambda: build_model(cfg, "cpu"), seed)
        except Exception as e:
            if model_plain.is_oom(e):
                raise AnnotationError(
                    model_plain.too_large(cfg.label, need, have, lacking, f" (building it failed: {e})")
                ) from None
            raise
        return shard(whole, layout, mesh, seed=seed, after_block=after_block, **shard_kwargs)

    model = model_plain.in_turns(make)
    model._meshlm_build = {"how": "host", "bytes": model_plain.model_bytes(model)}
    return model


def build_pipelined(cfg, mcfg: ModelConfig, layout: Any, device_type: str, *, seed: int = 0, **shard_kwargs: Any):
    """The run's model as a pipeline over ``mesh.pp`` (a layout with ``layers: pp``; NOTE
    [pipelined step] in meshlm/runtime/pipeline/pipe.py): this rank's ``Pipeline``, its stages'
    parameters sharded on the mesh without pp, ``train.grad_accum`` micro-batches a step."""
    from meshlm.models.node import loss_of
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh

    if mcfg.init_from:
        raise ConfigError(
            f"model.init_from={mcfg.init_from} with pipeline layout {layout.name}: loading Hugging Face weights "
            "into pipeline stages is not supported yet; convert them to a meshlm checkpoint first (meshlm "
            "convert, docs/checkpoint.md) and resume from it (checkpoint.resume=PATH), which any layout loads"
        )
    lacking = model_plain.lacking_init(build_model(mcfg, "meta"))
    if lacking:
        raise AnnotationError(
            f"model {mcfg.label} under pipeline layout {layout.name}: pipeline stages build the model on the meta "
            f"device and initialise it from train.seed, but {', '.join(f'`{m}`' for m in lacking[:5])} "
            "define no init_weights(generator). Define it on each (filling that module's own parameters and "
            "buffers), or train this plain model under a layout without pp (NOTE [model build] in "
            "meshlm/app/model_plain.py)"
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


def model_vocab(model: nn.Module) -> Optional[int]:
    """The model's vocabulary size: the smallest size of a parameter dim annotated with the
    logical axis ``vocab`` (embedding rows, head outputs); None if no parameter has one."""
    from meshlm.core.annotate import param_axes_of
    from meshlm.runtime.lowering import iter_params

    sizes = [
        p.shape[d]
        for _f, m, n, p in iter_params(model)
        for d, a in enumerate(param_axes_of(m).get(n, ()))
        if a == "vocab"
    ]
    return min(sizes) if sizes else None
