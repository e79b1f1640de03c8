"""The refusal of an attention call context parallel cannot run, in the model's terms: which
module called ``F.scaled_dot_product_attention`` with what, and what to do.

NOTE [cp refusal]
    The refusal is raised inside DTensor's dispatch of the CPU flash attention op (NOTE [cp
    dispatch] in meshlm/_torch_compat/dtensor_cp.py), where nothing names the model.  The
    Python frames of the call are still on the stack: the innermost one outside torch and
    meshlm is the model's own code, and its ``self``, when an ``nn.Module``, is the module
    that called attention.  Its class, function and line are what the message names.
"""

from __future__ import annotations

import sys
from typing import NoReturn, Optional

import torch

from meshlm.core.errors import ConfigError, is_model_code


def _caller() -> Optional[str]:
    """The innermost frame of the model's code: ``module `Cls` (Cls.forward, file:line)``."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if is_model_code(name):
            me = f.f_locals.get("self")
            where = f"{f.f_code.co_name}, {name}:{f.f_lineno}"
            if isinstance(me, torch.nn.Module):
                return f"module `{type(me).__name__}` ({type(me).__name__}.{where})"
            return f"`{where}`"
        f = f.f_back
    return None


def refuse(what: str) -> NoReturn:
    """Raise the ConfigError for an attention call with ``what`` under a cp split."""
    who = _caller() or "the model"
    raise ConfigError(
        f"{who} calls F.scaled_dot_product_attention with {what} on a sequence split over cp (the layout maps "
        "seq to cp: context parallel), which runs causal (is_causal=True) or unmasked attention without "
        "dropout only; call it with is_causal=True and no attn_mask or dropout_p in that module, or use a "
        "layout without seq: cp for this model (docs/cp.md, limits)"
    )
