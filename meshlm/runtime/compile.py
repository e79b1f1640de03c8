"""torch.compile policy: compile each block (``@meshlm.block`` module) on its own.

Per-block (regional) compilation compiles one graph per block class and reuses it for
every layer (the lowering gives all instances of a class one sharded subclass), keeps
compile time flat in depth, and leaves the embedding and loss, whose DTensor handlers are
plain Python, in eager mode.  ``fullgraph=True``: a graph break inside a block is an error.

NOTE [compiled body]
    ``comms="graph"`` (the default) compiles the whole block, its parameter gathers and
    gradient reductions included: they are traced into the block's forward and backward
    graphs, and a ZeRO-3 block re-gathers under selective checkpointing (storage cannot be
    freed inside a graph).  ``comms="eager"`` compiles only the math of the blocks that run
    on plain local tensors (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py: ddp, zero1/2, fsdp, hsdp):
    the flat gathers, the free and re-gather (NOTE [free and re-gather]), the prefetch
    (NOTE [prefetch]) and the gradient reductions run eagerly around the compiled graph, as
    FSDP2's hooks do around torchtitan's per-block compile.  Tensor-parallel blocks are
    compiled whole either way: their collectives are part of the math.  Main gradients
    (NOTE [main grads] in main_grad.py: bf16 ZeRO-1/2) are added in the reductions' eager
    backward, so they need ``comms="eager"``; a block compiled whole whose parameters have
    them is refused (ConfigError; traced, its parameters would get no gradient).  Measured on this
    project's 2-core CPU machine (benchmarks/step_phases.py --comms both, docs/benchmarks.md)
    the two are within noise of each other; "graph" stays the default until a GPU
    measurement says otherwise.

NOTE [static block shapes]
    Blocks are compiled with ``dynamic=False``.  Every block compiled whole runs through one
    code object (the lowering's ``block_forward`` under ``Module.compile``), so Dynamo keeps
    one cache for all of them: blocks of two classes with different activation shapes (a
    vision encoder's patches and a decoder's tokens) would otherwise make the second compile
    symbolic in the size that differs, and DTensor's view rules cannot place a view of
    symbolic size.  Static shapes give each (block class, shape) its own graph, within the
    recompile limit set below.

NOTE [compiled cp]
    Under a layout that splits the sequence over cp (docs/cp.md) a block's activations hold
    this rank's slice of every sequence, and a flattened (batch, sequence), the rows of
    every projection, is a ``_StridedShard`` on the batch and cp axes.  DTensor computes a
    strided shard's local size and offsets by splitting an ``arange`` and reading it back
    (``_StridedShard.local_shard_size_and_offset``).  Traced, that read-back fails: Dynamo
    runs DTensor's rules in its FakeTensorMode, where ``.tolist()`` on a fake tensor makes
    unbacked symbols no output holds (``PendingUnbackedSymbolNotFound``), and AOTAutograd
    runs them under its proxy and functional modes too, where the ``arange`` is traced and
    the read-back raises ("trying to get value out of a tracing tensor with
    aten._local_scalar_dense").  The indices depend on sizes only, so every compiled block
    of a cp model is called inside ``dtensor_index_math_untraced`` (meshlm/_torch_compat):
    that one function runs with no dispatch mode active, returns plain integers, and leaves
    nothing in the graph.  The attention is the two custom ops of NOTE [cp ops] in
    meshlm/runtime/cp/ops.py, called opaquely, and the balanced order's permutations
    (NOTE [balanced chunks] in meshlm/_torch_compat/dtensor_cp.py) trace as ordinary ops
    (``arange``, ``cat``, ``index_select``) whose indices depend on sizes only.  Checked with ``aot_eager`` against one device
    under fsdp_cp and fsdp_tp_cp (tests/dist/test_cp.py); the backward graph is traced with the forward at the first
    call, inside the same wrapper.  Inductor gets the same graphs and is not refused, but no
    test checks it under cp: four processes compiling C++ on the project's two-core CPU
    machine ran past ten minutes (docs/cp.md, compile).

Inductor blocks are compiled with ``fallback_random``: inductor otherwise replaces
``meshlm.dropout``'s key draw (an ``aten.randint`` on the global generator) with its own
generator, and the masks would no longer be the eager, one-device ones (NOTE [dropout keys]
in rng.py).  The only random op of a block is then a 0-d key, so the fallback costs nothing.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from meshlm import _torch_compat as compat
from meshlm.core.annotate import is_block
from meshlm.core.errors import ConfigError
from meshlm.runtime import COMPILE_COMMS, hooks


def compile_blocks(
    model: nn.Module,
    backend: str = "inductor",
    *,
    fullgraph: bool = True,
    mode: Optional[str] = None,
    comms: str = "graph",
) -> int:
    """Compile every block of ``model`` in place; return how many were compiled.
    ``comms``: whether the data-parallel collectives of local blocks are compiled with the
    block (``"graph"``) or run eagerly around its compiled math (``"eager"``; NOTE
    [compiled body])."""
    if comms not in COMPILE_COMMS:
        raise ValueError(f"compile_blocks(comms={comms!r}): expected one of {list(COMPILE_COMMS)}")
    _check_main_grads(model, comms)
    if any("_meshlm_param_offload" in m.__dict__ for m in model.modules()):
        raise ValueError(
            "compile_blocks: the blocks' parameters are offloaded already (offload.params); compile the blocks "
            "first, then offload (NOTE [offloaded parameters] in meshlm/runtime/offload/params.py)"
        )
    wrap = _cp_tracing(model)
    n = 0
    bodies: dict = {}  # one compiled body per block class, shared by its layers
    for m in model.modules():
        if is_block(m):
            if _eager_body(m, comms):
                cls = type(m)
                if cls not in bodies:
                    bodies[cls] = wrap(
                        torch.compile(
                            hooks.original_class(cls).forward,
                            backend=backend,
                            fullgraph=fullgraph,
                            dynamic=False,
                            **_mode(backend, mode),
                        )
                    )
                hooks.set_attrs(m, hooks.COMPILE, _meshlm_body=bodies[cls])
            else:
                hooks.compile_call(
                    m,
                    hooks.COMPILE,
                    wrap,
                    backend=backend,
                    fullgraph=fullgraph,
                    dynamic=False,
                    **_mode(backend, mode),
                )
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no @meshlm.block modules to compile")
    # Every layer of a model shares one compiled graph per block class; allow a few
    # recompiles per block for the first calls (grad mode, shapes) without warnings.
    compat.raise_recompile_limit(16)
    return n


def _cp_tracing(model: nn.Module) -> Callable[[Callable], Callable]:
    """How a compiled block of ``model`` is called: as it is, or, under a layout that splits
    the sequence over cp, inside ``dtensor_index_math_untraced`` (NOTE [compiled cp])."""
    st = getattr(model, "_meshlm_state", None)
    if st is None or st.cp_dim is None:
        return lambda fn: fn
    if st.cp is not None:
        st.cp.compiled = True  # NOTE [cp settings per model] in meshlm/runtime/cp/active.py

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with compat.dtensor_index_math_untraced():
                return fn(*args, **kwargs)

        return call

    return wrap


def _eager_body(m: nn.Module, comms: str) -> bool:
    """Whether block ``m`` gets only its math compiled, its collectives eager (NOTE
    [compiled body]); else it is compiled whole."""
    spec = getattr(m, "_meshlm_block", None)
    return comms == "eager" and spec is not None and spec.local and spec.key is not None


def _check_main_grads(model: nn.Module, comms: str) -> None:
    """Refuse to compile whole a block whose parameters have main gradients (NOTE [main
    grads] in main_grad.py): its gradient reductions, and the adds into the main gradients
    in their backward, would be traced into the block's graph, and its parameters would get
    no gradient at all (measured: a bf16 ZeRO-1/2 model trained only its embedding, final
    norm and head)."""
    gdt = getattr(getattr(model, "_meshlm_state", None), "grad_dtype", None)
    if gdt is None:
        return
    bad = [
        name
        for name, m in model.named_modules()
        if is_block(m) and not _eager_body(m, comms) and any(p.requires_grad and p.dtype != gdt for p in m.parameters())
    ]
    if not bad:
        return
    dt = next(p.dtype for p in model.get_submodule(bad[0]).parameters() if p.dtype != gdt)
    why = (
        "comms='graph' traces the gradient reductions into the block graphs"
        if comms == "graph"
        else "their collectives are part of their math (tensor parallel), so they are compiled whole"
    )
    raise ConfigError(
        f"compile_blocks(comms={comms!r}): blocks {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} store "
        f"parameters in {str(dt).removeprefix('torch.')} with {str(gdt).removeprefix('torch.')} main gradients "
        f"(NOTE [main grads] in meshlm/runtime/main_grad.py), which are added in eager code; {why}, where they would get "
        "no gradient. Use compile_blocks(comms='eager') (meshlm train: train.compile_comms=eager) on a layout "
        "whose blocks run on local tensors, or shard with float32 storage "
        "(meshlm.layout.precision.train_dtypes(..., main_grads=False); meshlm train does so for compile_comms=graph)"
    )


def _mode(backend: str, mode: str | None) -> dict:
    """torch.compile's ``mode`` argument, or for inductor the options of that mode plus
    ``fallback_random`` (random ops draw as eager does; see the module docstring)."""
    if backend != "inductor":
        return {"mode": mode}
    return {"options": {**(compat.inductor_mode_options(mode) if mode else {}), "fallback_random": True}}
