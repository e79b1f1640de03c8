"""Reference models.  Model code imports ``meshlm.annotate`` (and ``meshlm.axes``) only."""

from meshlm.models.llama import CONFIGS, Llama, LlamaConfig, llama_config, llama_fields, llama_model

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "llama_config", "llama_fields", "llama_model"]
