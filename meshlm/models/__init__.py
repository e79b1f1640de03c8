"""Reference models, written as a user's model would be: model code imports ``meshlm.core``
only (annotations, axes, the annotated layers; errors and ``arg_types`` to check the config
values a model is built from).  ``node.py`` is the ``model`` config node: any importable
callable that returns a module.

The names below load on first use (PEP 562), so reading a model node (``meshlm.models.node``)
imports no torch."""

import importlib

# public name -> the module that defines it
_HOME = {
    **dict.fromkeys(("GPT2", "GPT2Config", "gpt2_config", "gpt2_model"), "meshlm.models.gpt2"),
    **dict.fromkeys(
        ("CONFIGS", "Llama", "LlamaConfig", "llama_config", "llama_fields", "llama_model"), "meshlm.models.llama"
    ),
    **dict.fromkeys(("VLM", "VLMConfig", "vlm_config", "vlm_model"), "meshlm.models.vlm"),
}
_RENAMED = {"GPT2_CONFIGS": ("meshlm.models.gpt2", "CONFIGS"), "VLM_CONFIGS": ("meshlm.models.vlm", "CONFIGS")}


def __getattr__(name):
    home, attr = _RENAMED.get(name) or (_HOME.get(name), name)
    if home is None:
        raise AttributeError(f"module 'meshlm.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_HOME, *_RENAMED})


__all__ = sorted([*_HOME, *_RENAMED])
