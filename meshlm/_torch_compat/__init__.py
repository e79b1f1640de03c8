"""Every private torch API meshlm uses, in one package, for torch 2.11 to 2.13.

Private names (``torch._dynamo``, ``torch._C``, ``torch.distributed._functional_collectives``,
``torch.ops._c10d_functional``, ``torch.utils._python_dispatch``, autograd engine and node
internals, a DTensor's ``_local_tensor``) move between releases; here each is looked up
once, with the version differences spelled out, so that a new torch breaks this package
only.  This module holds the small wrappers; the ``dtensor_*.py`` files the DTensor op rules
meshlm adds through DTensor's dispatcher (NOTE [private torch] in dtensor_ops.py), which act
on meshlm's meshes only (NOTE [scoped patches] in dtensor_scope.py); ``dcp_metadata.py``
reads DCP's checkpoint metadata without running code.  Each file imports only files below it:

    dtensor_ops.py          installs the rules, each scoped to meshlm's meshes; waiting for a redistribute
    dtensor_replication.py  plain tensors next to DTensors as replicated, on meshlm's meshes only
    dtensor_alltoall.py     a shard-to-shard redistribute on a CPU mesh as one gloo all-to-all
    dtensor_costs.py        strategy costs of strided shards on meshes of three or more dims
    dtensor_views.py        views of a local tensor laid out unlike its global strides, strided unflatten
    dtensor_loss.py         cross entropy on class-sharded logits, the backward of mean-reduced losses
    dtensor_embedding.py    vocab-parallel embedding
    dtensor_cp.py           context-parallel attention on a cp-split sequence; balanced chunks
    dtensor_sdpa.py         CPU flash attention
    dtensor_scalar.py       a Python number read from a DTensor is the global value
    dtensor_scope.py        which DTensors are meshlm's: those on the meshes it made or sharded onto
    dtensor_base.py         what the rules share (wrap, default, contiguous_stride)
    dcp_metadata.py         DCP's .metadata pickle through an allow-list; a reader and planner that run no code

``tests/unit/test_torch_compat.py`` fails when any module of meshlm outside this package names
a private torch API.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

# TorchDispatchMode: the base of a mode that sees every aten op (CommCounter, PeakStorage)
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

# Version differences are detected by feature (``hasattr``, ``getattr`` with a fallback),
# never by comparing version numbers, so a patch release that backports a name just works.


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is ``major.minor`` or newer (local builds' ``+cpu`` ignored)."""
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return have >= (major, minor)


# --------------------------------------------------------------------------- Dynamo
# NOTE [lazy dynamo]
#     Importing torch._dynamo costs about a second of CPU, and ``meshlm plan`` by formula,
#     the layout tools and every command's start never compile.  So meshlm imports it on
#     first use: ``compiler_disable`` is torch's lazy ``disable`` (it imports Dynamo when the
#     function is first called), ``mark_dynamic`` reaches it when called, and
#     ``allow_in_graph`` registers its functions with Dynamo at once when Dynamo is loaded,
#     else at ``dynamo_ready()``, which ``meshlm.shard`` calls before it returns a model that
#     anything could compile (the functions it marks run only inside sharded models).
_PENDING_IN_GRAPH: list = []


def allow_in_graph(fn: Callable) -> Callable:
    """Mark a function as one opaque node for Dynamo, traced by AOTAutograd instead
    (NOTE [lazy dynamo])."""
    import sys

    if "torch._dynamo" in sys.modules:
        return torch._dynamo.allow_in_graph(fn)
    _PENDING_IN_GRAPH.append(fn)
    return fn


def dynamo_ready() -> None:
    """Register the functions ``allow_in_graph`` deferred (NOTE [lazy dynamo])."""
    while _PENDING_IN_GRAPH:
        torch._dynamo.allow_in_graph(_PENDING_IN_GRAPH.pop())


def compiler_disable(fn: Callable) -> Callable:
    """``torch.compiler.disable`` without importing Dynamo until ``fn`` is first called
    (NOTE [lazy dynamo]); older torch without the lazy form: the eager one."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def mark_dynamic(t: Tensor, dim: int) -> None:
    """A tensor's dim is a symbol from the first trace (a decode step's growing KV length)."""
    torch._dynamo.mark_dynamic(t, dim)


def dynamo_reset() -> None:
    """Forget every compiled graph (tests compile several models in one process)."""
    torch._dynamo.reset()


def raise_recompile_limit(n: int) -> None:
    """Let Dynamo recompile a function up to ``n`` times without warning (the option is
    ``recompile_limit`` from torch 2.7 on, ``cache_size_limit`` before)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), n))


def allow_side_effects_under_checkpoint() -> None:
    """Let Dynamo trace a Python side effect (a dict written and cleared) inside a
    checkpointed region without replaying it in backward.  The option exists from torch
    2.11 on; where it does not, nothing is set and such a region graph-breaks."""
    cfg = torch._dynamo.config
    if hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def fake_mode_active() -> bool:
    """Whether tensors are being traced as fake tensors now (AOTAutograd, FakeTensorMode)."""
    return torch._guards.detect_fake_mode() is not None


def inductor_mode_options(mode: str) -> dict:
    """The inductor options a ``torch.compile`` ``mode`` stands for."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_options(options: dict) -> dict:
    """``options`` less the inductor settings this torch does not have (they are all speed
    and reporting settings: without one, the compiled code is the same, or slower)."""
    import torch._inductor.config as cfg

    return {k: v for k, v in options.items() if hasattr(cfg, k)}


def inductor_config(options: dict):
    """A context in which inductor's settings are ``options`` (read when a call traces and
    compiles: dynamo reads ``freezing`` to guard on parameters' identity)."""
    import torch._inductor.config as cfg

    return cfg.patch(options)


def version_counter(t: Tensor) -> int:
    """How many in-place writes ``t``'s storage has seen (``Tensor._version``)."""
    return t._version


# --------------------------------------------------------------------------- autograd engine
def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


def backward_task_id() -> int:
    """An id of the backward pass running now on this thread (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass is done (inside backward only)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


#: a context manager: in-place writes to a tensor inside it do not bump its version counter
unsafe_preserve_version_counter = torch.autograd._unsafe_preserve_version_counter

# --------------------------------------------------------------------------- functional collectives
AsyncCollectiveTensor = funcol.AsyncCollectiveTensor
all_reduce = funcol.all_reduce
# torch 2.13 renamed all_gather_tensor to all_gather_single and reduce_scatter_tensor to
# reduce_scatter_single (the old names: deprecated aliases that warn on every eager call;
# 2.11 has only the old ones).  Both issue the same _c10d_functional op.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
#: the functional collective ops (``all_reduce``, ``wait_tensor``, ...) as they appear in traces
c10d_functional = torch.ops._c10d_functional


def resolve_process_group(name: str):
    """The process group a functional collective names by its group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_reduce_inplace(flat: Tensor, op: str, group: str, wait: bool) -> Tensor:
    """Reduce ``flat`` over ``group`` in place (eager only); ``wait=False``: left in flight
    as an AsyncCollectiveTensor."""
    out = c10d_functional.all_reduce_(flat, op, group)
    return c10d_functional.wait_tensor(out) if wait else funcol._maybe_wrap_tensor(out)


def in_flight(t: Tensor) -> bool:
    """Whether ``t`` is the result of an eager collective that has not been waited for."""
    return isinstance(t, AsyncCollectiveTensor)


# --------------------------------------------------------------------------- DTensor
def local_tensor(t) -> Tensor:
    """A DTensor's local tensor as it is stored (``to_local()`` would add an autograd node
    and wait for a collective in flight)."""
    return t._local_tensor


def local_offset(t) -> tuple[int, ...]:
    """Where the local shard of DTensor ``t`` starts in the global tensor (one offset per
    dim; the same on torch 2.11 to 2.13: ``_utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


def storage_nbytes_if_alive(ref) -> int:
    """The size now of the storage a ``StorageWeakRef`` points at (it must not have expired)."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


def fake_tensor_mode(**kwargs):
    """A new ``FakeTensorMode`` (``torch._subclasses``, private in every torch meshlm supports)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def dtensor_index_math_outside_fake():
    """While open, DTensor computes a strided shard's indices (``_StridedShard``'s
    ``local_shard_size_and_offset``: an ``arange`` split and read back with ``.tolist()``)
    outside any FakeTensorMode.  They are sizes, not data: under the planner's fake step the
    ``arange`` would be fake and its read-back raise ``DataDependentOutputException`` (e.g.
    a user's einsum attention under fsdp_tp: its ``bmm`` operands sharded over the batch and
    the flattened heads).  Outside a fake mode the wrapper changes nothing; restored on exit."""
    return _strided_index_math_under(outside_fake)


def dtensor_index_math_untraced():
    """As ``dtensor_index_math_outside_fake``, with every dispatch mode set aside while the
    indices are computed (``_disable_current_modes``): under ``torch.compile`` Dynamo runs
    DTensor's rules in its FakeTensorMode (the read-back would leave unbacked symbols no
    output holds: ``PendingUnbackedSymbolNotFound``) and AOTAutograd under its proxy and
    functional modes too (the ``arange`` would be traced and its read-back raise "trying to
    get value out of a tracing tensor with aten._local_scalar_dense").  The indices are
    plain Python integers either way, so the graph is the same without the ``arange``."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _strided_index_math_under(_disable_current_modes)


@contextlib.contextmanager
def _strided_index_math_under(context: Callable):
    """While open, ``_StridedShard.local_shard_size_and_offset`` runs inside ``context()``."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # no strided shards in this torch: nothing to do
        yield
        return
    orig = _StridedShard.__dict__.get("local_shard_size_and_offset")
    if orig is None:
        yield
        return

    fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig

    @functools.wraps(fn)
    def real_indices(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    _StridedShard.local_shard_size_and_offset = type(orig)(real_indices) if fn is not orig else real_indices
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = orig


def fake_unsupported_errors() -> tuple[type, ...]:
    """The exceptions a fake tensor raises for an op it cannot run without data (a value
    read back to Python, an output whose shape depends on the data, an op with no fake
    kernel)."""
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    return tuple(getattr(ft, n) for n in names if hasattr(ft, n))


def storage_key(st) -> int:
    """An untyped storage's identity: equal for two storages exactly when they are one
    storage, fake storages included (a fake tensor's storage has no data pointer)."""
    return st._cdata


# --------------------------------------------------------------------------- dispatch, fake PG, memory
def tree_leaves(tree) -> list:
    """The leaves of a pytree (``torch.utils._pytree``)."""
    return torch.utils._pytree.tree_leaves(tree)


def tree_map(fn, tree):
    """``fn`` applied to every leaf of a pytree (``torch.utils._pytree``)."""
    return torch.utils._pytree.tree_map(fn, tree)


def no_torch_function_subclass():
    """A context in which tensor subclasses' ``__torch_function__`` is not called
    (``torch._C.DisableTorchFunctionSubclass``: what a subclass's own handler runs under)."""
    return torch._C.DisableTorchFunctionSubclass()


def fake_store():
    """A ``FakeStore`` for the fake process group (``backend="fake"``); torch ships it only
    under ``torch.testing._internal`` (2.11 to 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def record_cuda_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording CUDA allocations for a memory snapshot."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)


# --------------------------------------------------------------------------- autograd nodes
def nll_node_fields(node) -> Optional[tuple[int, Tensor, Tensor]]:
    """(reduction, total weight, target) saved by an NLL loss's autograd node (reduction:
    0 none, 1 mean, 2 sum), or None if ``node`` is not one."""
    if node is None or type(node).__name__ != "NllLossBackward0":
        return None
    return node._saved_reduction, node._saved_total_weight, node._saved_target


# --------------------------------------------------------------------------- module calls
def wrap_module_call(m, outer: Callable) -> None:
    """Make ``m(*args, **kwargs)`` call ``outer(inner, *args, **kwargs)``, where ``inner`` is
    what ``m(...)`` called so far: its in-place compiled call (``Module.compile``) or
    ``Module._call_impl``.  Through ``Module._compiled_call_impl``, so ``outer`` runs outside
    any compiled region (torch 2.11 to 2.13); ``outer_call_wrapped`` tells whether it still
    does (a later ``m.compile()`` replaces it)."""
    inner = m._compiled_call_impl or m._call_impl

    def call(*args, **kwargs):
        return outer(inner, *args, **kwargs)

    call.meshlm_outer = outer
    m._compiled_call_impl = call


def outer_call_wrapped(m, outer: Callable) -> bool:
    return getattr(m._compiled_call_impl, "meshlm_outer", None) is outer


def own_call(m) -> Optional[Callable]:
    """What ``m(...)`` calls in place of ``Module._call_impl`` (``m``'s own
    ``_compiled_call_impl``), or None."""
    return m.__dict__.get("_compiled_call_impl")


def set_own_call(m, call: Optional[Callable]) -> None:
    """Make ``call`` what ``m(...)`` calls (``own_call``); None: ``Module._call_impl`` again."""
    if call is None:
        m.__dict__.pop("_compiled_call_impl", None)
    else:
        m._compiled_call_impl = call


def cpu_flash_attention() -> Optional[tuple[Callable, Callable]]:
    """(forward, backward) of torch's CPU flash attention kernel, or None where torch has none.

    ``forward(q, k, v, dropout_p, is_causal, *, scale)`` returns ``(out, logsumexp)``, the
    logsumexp float32 of shape (batch, heads, seq) over the scaled scores; ``backward(dout,
    q, k, v, out, logsumexp, dropout_p, is_causal, *, scale)`` returns ``(dq, dk, dv)``.  Both
    take grouped-query inputs (fewer key/value heads than query heads, dk and dv returned
    with the key/value heads) on every torch meshlm supports (2.11-2.13; the kernel reads key
    head ``h // (hq // hkv)`` since grouped-query SDPA came to the CPU in 2.5)."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None:
        return None
    return fwd.default, bwd.default


def is_view(t: Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (``Tensor._is_view``)."""
    return t._is_view()


def unbox_group(group):
    """The ProcessGroup a c10d op (``torch.ops.c10d.*``) received as a TorchScript object
    (what a TorchDispatchMode sees for ``torch.distributed.all_reduce``, ``send``, ...)."""
    if isinstance(group, torch.ScriptObject):
        return torch._C._distributed_c10d.ProcessGroup.unbox(group)
    return group


def outside_fake():
    """A context in which no FakeTensorMode is active (``unset_fake_temporarily``): what
    meta-device shape work (``meshlm.runtime.absent``) runs under inside the planner's fake step."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions, whose output specs name the mesh of the
    op that filled them: after a fake process group is torn down and another started (the
    planner, one per pp rank), a cached spec would hand a new DTensor the old mesh (equal by
    value, its process groups gone)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_fast = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ fast path (2.13)
    if clear_fast is not None:
        clear_fast()
    from torch.distributed.tensor import _redistribute

    clear_plans = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_plans is not None:
        clear_plans()
    # The cached transform plans and mesh topologies hold their specs' meshes, and so every
    # process group those meshes made: destroyed groups would otherwise live on, each with
    # gloo threads that keep polling (NOTE [shared pools] in tests/harness/dist.py).
    from torch.distributed.tensor import _collective_utils

    from meshlm._torch_compat import dtensor_views

    topo = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    for cached in (getattr(_redistribute, "_gen_transform_infos", None), topo, dtensor_views._strided_view_placements):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def stage_backward_input(outputs, output_grads, inputs, weights):
    """torch's zero-bubble input-gradient half of a stage's backward (what its ``I`` actions
    run): (input gradients, the parameter groups ``stage_backward_weight`` takes)."""
    from torch.distributed.pipelining._backward import stage_backward_input as f

    return f(outputs, output_grads, inputs, weights)


def stage_backward_weight(weights, param_groups) -> None:
    """The weight-gradient half (``W`` actions), into the parameters' ``.grad``."""
    from torch.distributed.pipelining._backward import stage_backward_weight as f

    f(weights, param_groups)
