"""Reference models, written as a user's model would be: model code imports ``meshlm.core``
only (annotations, axes, the annotated layers; errors and ``arg_types`` to check the config
values a model is built from).  ``node.py`` is the ``model`` config node: any importable
callable that returns a module.

The names below load on first use (PEP 562), so reading a model node (``meshlm.models.node``)
imports no torch."""

from meshlm.core.lazy import lazy_names

# public name -> the module that defines it ("module:attr" where it is named otherwise there)
_HOME = {
    **dict.fromkeys(("GPT2", "GPT2Config", "gpt2_config", "gpt2_model"), "meshlm.models.gpt2"),
    **dict.fromkeys(
        ("CONFIGS", "Llama", "LlamaConfig", "llama_config", "llama_fields", "llama_model"), "meshlm.models.llama"
    ),
    **dict.fromkeys(("VLM", "VLMConfig", "vlm_config", "vlm_model"), "meshlm.models.vlm"),
    **dict.fromkeys(("MoEConfig", "MoETransformer", "moe_config", "moe_fields", "moe_model"), "meshlm.models.moe"),
    "GPT2_CONFIGS": "meshlm.models.gpt2:CONFIGS",
    "MOE_CONFIGS": "meshlm.models.moe:CONFIGS",
    "VLM_CONFIGS": "meshlm.models.vlm:CONFIGS",
}

__getattr__, __dir__ = lazy_names("meshlm.models", globals(), _HOME)

__all__ = sorted(_HOME)
