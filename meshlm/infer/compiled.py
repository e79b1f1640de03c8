"""The compiled decode step of ``meshlm.infer.generate`` (``compile=`` a torch.compile backend).

NOTE [compiled decode]
    One compiled decode step per backend, for every model and call, with dynamic shapes:
    the number of cached positions attention reads (and the batch) are symbols, so one
    graph serves every position of every call, and attention reads the written slots only.
    A static cache (NOTE [static cache] in cache.py) is traced once too, but attends to all
    max_len slots at every step: on llama_small's shape at batch 8 it decoded 3,372
    tokens/s where this does 5,658 (and eager 4,151; 2 cores, 64 + 128 positions).

NOTE [frozen decode]
    On CPU, with inductor, the decode step is compiled with the weights frozen into the
    graph (inductor's ``freezing``): they become constants, laid out ahead of time for
    oneDNN's linear kernels, and autotuning (``max_autotune`` over inductor's C++ GEMM
    templates and ATen) picks each matmul's kernel for its shape.  A decode step is a
    chain of small matmuls (batch rows against each weight), so this is where its time goes:
    on 2 cores it decoded 1.2x to 3.4x more tokens/s than the same step compiled without
    (benchmarks/generate_speed.py; docs/inference.md has the table).

    Frozen weights are a copy: the compiled step does not see a later change to the
    parameters.  So a frozen step belongs to one model and one state of its weights: it is
    kept per model (weakly) with a fingerprint of every parameter and buffer (its storage
    address and its version counter, which every in-place write advances), and a call with
    another fingerprint compiles afresh (a new code object, so that dynamo's cache of the
    stale graph is not consulted).  The copy also costs memory, the weights' bytes once
    more for each graph (batch 1 is traced apart from larger batches): ``freeze=False``
    keeps the shared, unfrozen step.

    Frozen only where nothing else moves the weights: plain tensors on the CPU, not a
    sharded model's DTensors (their collectives and placements are what the graph runs),
    not blocks whose parameters are streamed in per call (inference placement, offload)
    or run on another stage.  ``freeze=None`` (the default) freezes where it can;
    ``freeze=True`` where it cannot is an error that says why.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.core.errors import ConfigError

Step = Callable[[nn.Module, Tensor, object], Tensor]

# NOTE [frozen decode]: what inductor is asked for, on CPU; its autotuning reports go unprinted
FROZEN_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def _decode(model: nn.Module, tokens: Tensor, cache) -> Tensor:
    return model(tokens, cache=cache)


_COMPILED: dict[str, Step] = {}
_FROZEN: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Step]]" = weakref.WeakKeyDictionary()


# what compiling a decode step prints that is no news to its user: dynamo's notes on the
# DTensor internals it traces around (on every rank of a sharded model), inductor's autotuning
_QUIET = ("Dynamo does not know how to trace the builtin", "TypedStorage is deprecated")


def _quiet(compiled, options: Optional[dict] = None) -> Step:
    """``compiled`` called with ``_QUIET`` unprinted and, where given, inductor's settings
    ``options`` in effect (read as a call traces and compiles)."""

    def step(m: nn.Module, tokens: Tensor, cache) -> Tensor:
        with compat.inductor_config(options) if options else contextlib.nullcontext(), warnings.catch_warnings():
            for text in _QUIET:
                warnings.filterwarnings("ignore", text)
            return compiled(m, tokens, cache)

    return step


def unfrozen(backend: str) -> Step:
    """The shared decode step compiled by ``backend`` (NOTE [compiled decode])."""
    if backend not in _COMPILED:
        _COMPILED[backend] = _quiet(torch.compile(_decode, backend=backend, dynamic=True))
    return _COMPILED[backend]


def why_not_frozen(model: nn.Module, backend: str) -> Optional[str]:
    """Why ``model``'s decode step cannot be frozen (NOTE [frozen decode]), or None."""
    if backend != "inductor":
        return f"compile={backend!r}: only inductor freezes weights"
    if getattr(model, "_meshlm_state", None) is not None:
        return "the model is sharded (its decode step runs the layout's collectives on DTensors)"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"parameter {name} is a DTensor"
        if p.device.type != "cpu":
            return f"parameter {name} is on {p.device}; weights are frozen on the CPU only"
    from meshlm.infer.stages import _ATTR as STAGED
    from meshlm.runtime.offload.params import OFFLOAD_ATTR as STREAMED

    for name, m in model.named_modules():
        if STAGED in m.__dict__ or STREAMED in m.__dict__:
            return f"block {name or type(m).__name__} is streamed in per call or runs on another stage"
    return None


def _fingerprint(model: nn.Module) -> tuple:
    ts = [*model.parameters(), *model.buffers()]
    return tuple((t.data_ptr(), compat.version_counter(t)) for t in ts)


def _frozen(model: nn.Module) -> Step:
    key = _fingerprint(model)
    hit = _FROZEN.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    # a code object of its own: dynamo keeps its compiled graphs (and their frozen weights) on it
    fn = types.FunctionType(_decode.__code__.replace(co_name="_decode_frozen"), _decode.__globals__)
    step = _quiet(torch.compile(fn, backend="inductor", dynamic=True), compat.inductor_options(FROZEN_OPTIONS))
    _FROZEN[model] = (key, step)
    return step


def decode_step(model: nn.Module, backend: str, freeze: Optional[bool] = None) -> Step:
    """The compiled decode step for ``model`` (NOTE [compiled decode], NOTE [frozen decode])."""
    why = why_not_frozen(model, backend)
    if freeze and why is not None:
        raise ConfigError(f"generate: freeze=True, but the weights cannot be frozen: {why}; use freeze=False")
    if freeze is False or why is not None:
        return unfrozen(backend)
    return _frozen(model)
