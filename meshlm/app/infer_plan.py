"""``meshlm plan generate``: the placement ``meshlm generate --max-memory-per-device`` would
choose (NOTE [inference placement] in placement.py) and the memory it needs, KV cache
included, for a batch and context length, without loading a weight: a Hugging Face
directory, a meshlm checkpoint, or a shipped model name (``llama3_8b``, ``gpt2``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from meshlm.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshlm plan generate", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a Hugging Face directory, a meshlm checkpoint, or a shipped model name")
    p.add_argument("--max-memory-per-device", required=True, help="e.g. 16GiB")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--context", type=int, default=2048, help="prompt + new tokens, the longest")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="the weights' dtype (default: as stored)")
    p.add_argument("--offload", default="disk", choices=("disk", "host"))
    p.add_argument("--devices", type=int, default=1, help="one stage per device (meshlm generate --mesh pp=N)")
    return p


def meta_model(source: str):
    """The model of ``source`` on the meta device."""
    from meshlm.models import CONFIGS, GPT2_CONFIGS

    if source in CONFIGS:
        from meshlm.models import Llama

        return Llama(CONFIGS[source], device="meta")
    if source in GPT2_CONFIGS:
        from meshlm.models.gpt2 import GPT2

        return GPT2(GPT2_CONFIGS[source], device="meta")
    path = Path(source.removeprefix("hf:"))
    if not path.exists():
        names = ", ".join([*CONFIGS, *GPT2_CONFIGS])
        raise ConfigError(f"{source!r}: no such directory, and no shipped model of that name ({names})")
    from meshlm.app.generate import _meta_model

    return _meta_model(path)


def plan_generate_main(argv: list[str]) -> int:
    from meshlm.infer.placement import place
    from meshlm.plan.search import parse_memory

    a = parser().parse_args(argv)
    if a.batch < 1 or a.context < 1:
        raise ConfigError(f"--batch={a.batch} and --context={a.context} must be at least 1")
    model = meta_model(a.source)
    if a.dtype:
        model = model.to(DTYPES[a.dtype])
    if a.devices < 1:
        raise ConfigError(f"--devices={a.devices} must be at least 1")
    pl = place(model, parse_memory(a.max_memory_per_device), a.batch, a.context, a.offload, devices=a.devices)
    sys.stdout.write(pl.describe() + "\n")
    return 0
