"""Reference models.  Model code imports ``meshlm.annotate``, ``meshlm.axes`` and ``meshlm.nn`` only (and
``meshlm.errors``, ``meshlm.arg_types`` to check the config values a model is built from)."""

from meshlm.models.gpt2 import CONFIGS as GPT2_CONFIGS
from meshlm.models.gpt2 import GPT2, GPT2Config, gpt2_config, gpt2_model
from meshlm.models.llama import CONFIGS, Llama, LlamaConfig, llama_config, llama_fields, llama_model
from meshlm.models.vlm import CONFIGS as VLM_CONFIGS
from meshlm.models.vlm import VLM, VLMConfig, vlm_config, vlm_model

__all__ = [
    "CONFIGS",
    "GPT2",
    "GPT2Config",
    "GPT2_CONFIGS",
    "Llama",
    "LlamaConfig",
    "VLM",
    "VLMConfig",
    "VLM_CONFIGS",
    "gpt2_config",
    "gpt2_model",
    "llama_config",
    "llama_fields",
    "llama_model",
    "vlm_config",
    "vlm_model",
]
