"""Reference models.  Model code imports ``meshlm.annotate`` (and ``meshlm.axes``) only."""

from meshlm.models.llama import CONFIGS, Llama, LlamaConfig, llama_config

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "llama_config"]
