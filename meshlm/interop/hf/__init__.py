"""Hugging Face safetensors <-> sharded meshlm models (Llama, GPT-2, LLaVA, Mixtral, Qwen2-MoE,
Qwen3-MoE), with no full model on any rank.

* :func:`load_hf` reads ``config.json`` and ``model.safetensors`` (or sharded files and
  ``model.safetensors.index.json``, or ``pytorch_model.bin``) into the meshlm model its
  ``model_type`` names (``llama``: :class:`meshlm.models.Llama`, ``gpt2``:
  :class:`meshlm.models.GPT2`, ``llava``: :class:`meshlm.models.VLM`, ``mixtral``, ``qwen2_moe``, ``qwen3_moe``:
  :class:`meshlm.models.MoETransformer`) sharded under any
  layout: each rank reads only the block of each tensor it stores
  (``safe_open(...).get_slice``).
* :func:`save_hf` writes a live sharded model as a Hugging Face directory
  (``config.json`` + one consolidated ``model.safetensors``) that ``transformers`` loads:
  rank 0 writes the header, then every rank ``pwrite``s the blocks it owns (one replica of
  each) straight to their offsets, so no rank ever holds the whole model.
* ``meshlm.train.convert.export_checkpoint`` does that for a training checkpoint (``meshlm convert``).

What differs between the architectures (names, shapes, how a meshlm block maps onto the HF
tensor, the config) lives in one module per ``model_type``: meshlm/interop/hf/llama.py (NOTE [HF
names]), meshlm/interop/hf/gpt2.py (NOTE [HF GPT-2 tensors]), meshlm/interop/hf/llava.py (NOTE [HF LLaVA
tensors]), meshlm/interop/hf/mixtral.py (NOTE [HF Mixtral tensors]) and
meshlm/interop/hf/qwen2_moe.py, meshlm/interop/hf/qwen3_moe.py (NOTE [HF Qwen-MoE tensors] in
meshlm/interop/hf/qwen_moe.py).  This module is the
public face; the machinery is in

    save.py      save_hf: the safetensors header and each rank's blocks
    load.py      load_hf, model_of: each rank reads its blocks of the files
    family.py    model_type -> family module, reading config.json

and checkpoint <-> Hugging Face directory (``meshlm convert``) is meshlm/train/convert.py.
"""

from __future__ import annotations

from meshlm.interop.hf.family import read_hf_config
from meshlm.interop.hf.llama import config_from_hf as hf_config_to_llama
from meshlm.interop.hf.llama import config_to_hf as llama_to_hf_config
from meshlm.interop.hf.llama import hf_name
from meshlm.interop.hf.load import load_hf
from meshlm.interop.hf.load import model_of as model_of  # meshlm.plan plans an init_from model
from meshlm.interop.hf.save import save_hf

__all__ = [
    "load_hf",
    "save_hf",
    "read_hf_config",
    "hf_config_to_llama",
    "llama_to_hf_config",
    "hf_name",
]
