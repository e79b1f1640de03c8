"""Hugging Face directories <-> meshlm training checkpoints (``meshlm convert``):
:func:`import_hf` makes a step-0 checkpoint of a Hugging Face directory,
:func:`export_checkpoint` writes a checkpoint as a Hugging Face directory, and
:func:`convert_main` is the command, which picks the direction from its source.  Under
torchrun every rank handles only its shard."""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from meshlm.core.errors import CheckpointError, ConfigError
from meshlm.interop.hf.family import family_of_class, strip_scheme
from meshlm.interop.hf.load import load_hf
from meshlm.interop.hf.save import save_hf
from meshlm.layout.precision import DTYPES as _DTYPES


def model_for_checkpoint(ckpt: str, layout: str, mesh_shape: Optional[str]):
    import torch.distributed as dist

    from meshlm.layout.mesh import make_mesh
    from meshlm.runtime.lowering import shard
    from meshlm.train.checkpoint import read_meta, resolve_path

    ckpt = resolve_path(ckpt)
    meta = read_meta(ckpt)
    cfgd = meta.get("model", {}).get("config")
    if not cfgd:
        raise CheckpointError(f"{ckpt}/meta.json: has no model config; cannot rebuild the model to export it")
    fam = family_of_class(meta["model"].get("class", "Llama"))
    cfg = fam.config_class()(**cfgd)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    mesh = make_mesh(mesh_shape or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = shard(fam.build(cfg), layout if world > 1 or mesh_shape else "single", mesh)
    return ckpt, model


def export_checkpoint(
    ckpt: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> str:
    """Export a meshlm training checkpoint (a ``step_*`` directory, or a run directory: its
    latest) to a Hugging Face directory.  Run under torchrun to split the work: every rank
    loads and writes only its ``layout`` shard of each tensor."""
    import json
    import shutil

    import torch.distributed as dist

    from meshlm.train.checkpoint import load_checkpoint
    from meshlm.train.checkpoint.assets import GENERATION_CONFIG, HF_CONFIG, TOKENIZER_FILES, dir_assets

    ckpt, model = model_for_checkpoint(ckpt, layout, mesh)
    load_checkpoint(ckpt, model=model, optimizer=None, restore_rng=False)
    assets = dir_assets(ckpt)  # NOTE [run tokenizer] in meshlm/train/checkpoint/assets.py

    def _json(name):
        return json.loads(open(assets[name]).read()) if name in assets else None

    path = save_hf(model, out, dtype=dtype, source_config=_json(HF_CONFIG), source_generation=_json(GENERATION_CONFIG))
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name in TOKENIZER_FILES:
            if name in assets:
                shutil.copyfile(assets[name], os.path.join(out, name))
    return path


def import_hf(path: str, out: str, *, layout: str = "fsdp", mesh: Optional[str] = None) -> str:
    """Convert a Hugging Face Llama or GPT-2 directory to a meshlm checkpoint (step 0, weights only)."""
    import torch.distributed as dist

    from meshlm.layout.mesh import make_mesh
    from meshlm.train.checkpoint import CheckpointConfig, Checkpointer
    from meshlm.train.checkpoint.assets import hf_assets

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    m = make_mesh(mesh or (f"fsdp={world}" if world > 1 else "dp=1"))
    model = load_hf(path, layout if world > 1 or mesh else "single", m)
    # a run of its own (step 0): `meshlm train checkpoint.dir=OUT checkpoint.resume=auto` continues it
    ck = Checkpointer(CheckpointConfig(dir=out, keep=0), model=model, run_meta={"converted_from": strip_scheme(path)})
    ck.assets = hf_assets(strip_scheme(path))  # its tokenizer and config travel (NOTE [run tokenizer])
    try:
        return ck.save(0, {"step": 0, "init_from": f"hf:{strip_scheme(path)}"})
    finally:
        ck.close()  # lets go of OUT's lock (NOTE [one writer per checkpoint directory])


def convert_main(argv: list[str]) -> int:
    """``meshlm convert SRC DST``: a Hugging Face Llama or GPT-2 directory -> a meshlm checkpoint under
    DST, or a meshlm checkpoint (or run directory) -> a Hugging Face directory DST.  The
    direction follows SRC (``config.json`` = Hugging Face).  Under torchrun every rank
    handles only its shard."""
    p = argparse.ArgumentParser(prog="meshlm convert", description=convert_main.__doc__)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", default="fsdp", help="layout used while converting (under torchrun)")
    p.add_argument("--mesh", default=None, help="mesh while converting, e.g. fsdp=4 (default: fsdp=world size)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="dtype of the exported safetensors")
    a = p.parse_args(argv)
    src = strip_scheme(a.src)
    if not os.path.exists(src):
        import sys

        print(
            f"meshlm convert: {a.src}: no such file or directory; SRC is a Hugging Face directory (with "
            "config.json) or a meshlm checkpoint (a step_* directory, or a checkpoint.dir: its latest)",
            file=sys.stderr,
        )
        return 2
    try:
        if os.path.isfile(os.path.join(src, "config.json")):
            out = import_hf(src, a.dst, layout=a.layout, mesh=a.mesh)
            what = "meshlm checkpoint"
        else:
            out = export_checkpoint(src, a.dst, layout=a.layout, mesh=a.mesh, dtype=_DTYPES.get(a.dtype or ""))
            what = "Hugging Face directory"
    except (CheckpointError, ConfigError) as e:
        import sys

        print(f"meshlm convert: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {what} {out}")
    return 0
