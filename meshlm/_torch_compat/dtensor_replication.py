"""Plain tensors meeting DTensors as replicated values, on meshlm's meshes only (part of the
adapter in ``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE
[private torch] there; NOTE [scoped patches] in dtensor_scope.py).

NOTE [implicit replication]
    Model code makes plain tensors inside forward (RoPE tables, masks, positions) and
    autograd saves them for backward.  They are identical on every rank, so treating them
    as Replicate is exact.  torch's ``implicit_replication()`` context only covers code
    inside it, and the backward of a loss returned from forward runs after it has been
    left.  Inputs are wrapped as DTensors by the lowering, so rank-local data is never
    mistaken for replicated data; a plain tensor that differs across ranks (``torch.rand``
    in forward) would be, so draw random numbers from DTensors.

    Where DTensor decides (torch 2.11-2.13): its C++ entry refuses an op with a plain
    tensor argument (of more than one element) unless the thread's flag
    (``torch._C._get_dtensor_allow_implicit_replication``) is on; ``backward()`` captures
    the flag for its whole pass, every node runs with the captured value.  Past the C++
    check, on a miss of DTensor's sharding cache, the Python method
    ``OpDispatcher._try_replicate_spec_for_scalar_tensor`` builds the replicated spec, or
    raises if the flag (read through the ``_allow_implicit_replication`` property) is off.
    So meshlm:

    - switches the C++ flag on in a thread that runs a sharded forward and leaves it on
      (``hold``): the backward comes later, called from the user's code;
    - patches the Python method: replicated on meshlm's meshes; on any other mesh, torch's
      own method, which reads the flag through the property;
    - patches the property to read and write the flag as torch code set it (the stock
      value): ``implicit_replication()`` and user code see and set their own value, and
      meshlm's part in the C++ flag is kept apart.  The stock value is kept with the
      thread-local Python objects autograd carries into its engine threads
      (``torch._C._stash_obj_in_tls``), so a backward on CUDA's device threads sees the
      caller's;
    - clears DTensor's sharding caches when the stock value goes from on to off in a thread
      where meshlm holds the C++ flag on: C++ serves a cached op without asking the flag
      again, and an op stock code ran inside ``implicit_replication()`` must be refused
      outside it as without meshlm.

    What cannot be told apart: torch's C++ composites that switch the C++ flag on around
    one inner op (``F.one_hot`` of a DTensor compares it with a plain ``arange``) do it
    invisibly where meshlm holds the flag on, so in a thread that ran a sharded forward
    that inner op is refused on another mesh (stock code only: on meshlm's meshes it is
    replicated).
"""

from __future__ import annotations

import inspect
import threading

import torch
from torch.distributed.tensor import Replicate

from meshlm._torch_compat import compiler_disable as _compiler_disable
from meshlm._torch_compat.dtensor_scope import owns

_KEY = "meshlm_dtensor_stock_implicit_replication"
_C_FLAG = hasattr(torch._C, "_get_dtensor_allow_implicit_replication")
_STASH = all(hasattr(torch._C, n) for n in ("_stash_obj_in_tls", "_get_obj_in_tls", "_is_key_in_tls"))
_local = threading.local()  # where the stash is missing: this thread only
_orig_replicate = None


def _has() -> bool:
    return torch._C._is_key_in_tls(_KEY) if _STASH else hasattr(_local, "stock")


def _get_saved() -> bool:
    return bool(torch._C._get_obj_in_tls(_KEY)) if _STASH else _local.stock


def _save(value: bool) -> None:
    if _STASH:
        torch._C._stash_obj_in_tls(_KEY, value)
    else:
        _local.stock = value


def _c_flag() -> bool:
    return torch._C._get_dtensor_allow_implicit_replication()


def _set_c_flag(value: bool) -> None:
    torch._C._set_dtensor_allow_implicit_replication(value)


def stock_flag() -> bool:
    """The implicit-replication flag as torch code set it in this thread (meshlm's part left out)."""
    return _get_saved() if _has() else _c_flag()


def _set_stock_flag(_dispatcher, value) -> None:
    value = bool(value)
    if not _has():  # meshlm holds nothing here: the flag is torch's
        _set_c_flag(value)
        return
    was = _get_saved()
    _save(value)
    _set_c_flag(True)
    if was and not value:
        from meshlm._torch_compat import clear_dtensor_caches

        clear_dtensor_caches()


@_compiler_disable  # thread state, not graph: run as is where a compiled root's forward calls it
def hold() -> None:
    """Let DTensor treat plain tensors as replicated on meshlm's meshes in this thread, in
    forward and in every later backward (NOTE [implicit replication])."""
    if not _C_FLAG:
        return  # a DTensor that decides in Python only: the patched method alone decides
    if not _has():
        _save(_c_flag())
    if not _c_flag():
        _set_c_flag(True)


def _replicate_spec(dispatcher, op_call, tensor_arg, compute_mesh, *rest):
    if owns(compute_mesh):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(shape=tensor_arg.shape, stride=tensor_arg.stride(), dtype=tensor_arg.dtype)
        return DTensorSpec(compute_mesh, (Replicate(),) * compute_mesh.ndim, tensor_meta=meta)
    return _orig_replicate(dispatcher, op_call, tensor_arg, compute_mesh, *rest)


def install() -> None:
    """Patch DTensor's dispatcher class: the method that replicates a plain tensor, and the
    flag's property (where the flag is torch's C++ thread-local one).  Once per process."""
    global _orig_replicate
    from torch.distributed.tensor._dispatch import OpDispatcher

    if _orig_replicate is not None:
        return
    _orig_replicate = OpDispatcher._try_replicate_spec_for_scalar_tensor
    OpDispatcher._try_replicate_spec_for_scalar_tensor = _replicate_spec
    if _C_FLAG and isinstance(inspect.getattr_static(OpDispatcher, "_allow_implicit_replication", None), property):
        OpDispatcher._allow_implicit_replication = property(lambda _d: stock_flag(), _set_stock_flag)
