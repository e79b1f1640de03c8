"""Which meshlm module knows each Hugging Face architecture, and a Hugging Face directory's
config: ``model_type`` in ``config.json`` -> the family module (meshlm/interop/hf/llama.py,
meshlm/interop/hf/gpt2.py, meshlm/interop/hf/llava.py, meshlm/interop/hf/mixtral.py,
meshlm/interop/hf/qwen2_moe.py, meshlm/interop/hf/qwen3_moe.py) with that architecture's names,
shapes and config, and the meshlm config (LlamaConfig, GPT2Config, VLMConfig or MoEConfig) that ``config.json`` describes.
Shared by loading (meshlm/interop/hf/load.py), saving (meshlm/interop/hf/save.py) and conversion
(meshlm/train/convert.py)."""

from __future__ import annotations

import importlib
import json
import os

from torch import nn

from meshlm.core.errors import CheckpointError, ConfigError

# model_type in config.json -> the module that knows that architecture's names, shapes and
# config (``hf_tensor``, ``read_block``, ``write_blocks``, ``config_from_hf``, ...).  A
# family whose parameter may be several HF tensors (Mixtral's experts, one tensor each) also
# has ``hf_tensors`` and names the tensor of each block ``write_blocks`` gives.  Families
# that build the same meshlm model (Mixtral, Qwen2-MoE and Qwen3-MoE: a MoETransformer)
# say with ``owns(cfg)`` which configs export as theirs; the one without ``owns`` takes the rest.
_FAMILIES = {
    "llama": "meshlm.interop.hf.llama",
    "gpt2": "meshlm.interop.hf.gpt2",
    "llava": "meshlm.interop.hf.llava",
    "mixtral": "meshlm.interop.hf.mixtral",
    "qwen2_moe": "meshlm.interop.hf.qwen2_moe",
    "qwen3_moe": "meshlm.interop.hf.qwen3_moe",
}


def _family(model_type: str, source: str):
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"{source}: model_type={model_type!r}; meshlm imports Hugging Face "
            f"{', '.join(_FAMILIES)} models (meshlm.models.Llama, meshlm.models.GPT2, meshlm.models.VLM, "
            "meshlm.models.MoETransformer)"
        )
    return importlib.import_module(_FAMILIES[model_type])


def _family_of(model: nn.Module):
    """The family of a meshlm model: by the class of its ``cfg``, then, among the families
    of that class, the one that ``owns`` it (else the one with no ``owns``)."""
    cfg = getattr(model, "cfg", None)
    fams = [f for f in (_family(mt, "") for mt in _FAMILIES) if isinstance(cfg, f.config_class())]
    for fam in sorted(fams, key=lambda f: not hasattr(f, "owns")):
        if getattr(fam, "owns", lambda _cfg: True)(cfg):
            return fam
    raise CheckpointError(
        f"{type(model).__name__}: meshlm exports its Llama, GPT2 and VLM to Hugging Face form "
        "(a model with a LlamaConfig, GPT2Config or VLMConfig as .cfg) and its MoETransformer (as "
        "Mixtral, Qwen2-MoE or Qwen3-MoE), not this model"
    )


def family_of_class(name: str):
    """The family whose meshlm class is ``name`` (a checkpoint's meta.json ``model.class``)."""
    for mt in _FAMILIES:
        fam = _family(mt, "")
        if fam.CLASS == name:
            return fam
    raise CheckpointError(
        f"the checkpoint holds a {name}; meshlm exports its Llama, GPT2, VLM and MoETransformer to "
        "Hugging Face form only"
    )


def strip_scheme(path: str) -> str:
    return path[3:] if path.startswith("hf:") else path


def _read_config(path: str):
    """(family, meshlm config) of the Hugging Face directory ``path``."""
    path = strip_scheme(path)
    f = os.path.join(path, "config.json")
    try:
        with open(f) as fh:
            hf = json.load(fh)
        fam = _family(hf.get("model_type", "llama"), f)
        return fam, fam.config_from_hf(hf, f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{f}: missing; a Hugging Face model directory holds config.json and "
            "model.safetensors (or model.safetensors.index.json, or pytorch_model.bin)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{f}: not a Hugging Face Llama, GPT-2, LLaVA, Mixtral, Qwen2-MoE or Qwen3-MoE config ({type(e).__name__}: {e})"
        ) from None


def hf_tensors(fam, cfg, fqn: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of each Hugging Face tensor meshlm parameter ``fqn`` is made of."""
    if hasattr(fam, "hf_tensors"):
        return fam.hf_tensors(cfg, fqn, shape)
    return [fam.hf_tensor(cfg, fqn, shape)]


def write_blocks(fam, cfg, fqn: str, shape: tuple[int, ...], box, local):
    """(HF name, row-major shape, box, block) to write for this rank's block ``local`` of
    ``fqn``: the family's ``write_blocks``, named."""
    out = fam.write_blocks(cfg, fqn, shape, box, local)
    if hasattr(fam, "hf_tensors"):
        return out
    name = fam.hf_tensor(cfg, fqn, shape)[0]
    return [(name, *entry) for entry in out]


def read_hf_config(path: str):
    """The meshlm config (LlamaConfig, GPT2Config, VLMConfig or MoEConfig) of a Hugging Face directory."""
    return _read_config(path)[1]
