"""The sharded model's root forward: inputs in, outputs out.

Every tensor leaf of the inputs (inside dicts, lists, tuples, named tuples, dataclasses:
``meshlm.core.tree``) is each rank's slice of a global input, placed by the layout's input
rules for its logical axes: the model's ``input_axes`` entry for the leaf's path
(``"tokens"``, ``"batch.images"``), else ``("batch", "seq", None, ...)`` for its dims.
The root then runs either under DTensor (``constrain`` redistributes, a 0-d output comes
back as a plain tensor) or, under a pure data-parallel layout, on local tensors (NOTE
[local root] in lowering/local_root.py).  Either way the user's forward runs exactly once per call.

"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlm._torch_compat import dtensor_ops
from meshlm.core import tree, weighting
from meshlm.core.state import eager, scope
from meshlm.runtime.cp import active as cp_active
from meshlm.runtime.lowering import buffers
from meshlm.runtime.lowering.inputs import arguments, input_axes, set_arguments, wrap_input
from meshlm.runtime.lowering.local_root import local_root_forward, local_rows


def root_forward(self, *args, **kwargs):
    """The forward of a sharded root module (installed by ``meshlm.shard``); the buffers it
    changed are then averaged over the ranks (NOTE [buffers] in lowering/buffers.py)."""
    st = self._meshlm_state
    if not st.has_buffers or torch.compiler.is_compiling():
        return _root_forward(self, st, *args, **kwargs)
    before = buffers.versions(self)
    out = _root_forward(self, st, *args, **kwargs)
    buffers.average_changed(self, st.mesh, before)
    return out


def _root_forward(self, st, *args, **kwargs):
    if st.cp is None or torch.compiler.is_compiling():
        return _root_body(self, st, *args, **kwargs)
    cp_active.enter_forward(st.cp)  # NOTE [cp settings per model] in meshlm/runtime/cp/active.py
    out = _root_body(self, st, *args, **kwargs)
    cp_active.leave_forward(st.cp, out)
    return out


def _root_body(self, st, *args, **kwargs):
    orig = self._meshlm_orig_forward
    bound = inspect.signature(orig).bind(self, *args, **kwargs)
    inputs = arguments(bound)
    leaves = tree.tensor_leaves(inputs)  # raises for tensors meshlm cannot see
    if st.root is not None and torch.is_grad_enabled() and eager():
        rows = local_rows(self, st, leaves)
        if rows is not None:
            st.local_now = True
            return local_root_forward(self, st, orig, bound, inputs, rows)
    st.local_now = False
    if not torch.compiler.is_compiling():  # a compiled root (a decode step) must not guard on the count
        st.roots["dtensor"] += 1

    def wrap(path: str, t: Tensor) -> Tensor:
        return t if isinstance(t, DTensor) else wrap_input(st, t, input_axes(self, path, t.ndim))

    set_arguments(bound, tree.map_tensors(inputs, wrap))
    dtensor_ops.allow_implicit_replication()
    local_mods = st.local_block_modules if st.has_buffers else set()
    with scope(handler=st.handler), buffers.replicated(self, st.mesh, local_mods):  # NOTE [buffers]
        out = orig(*bound.args, **bound.kwargs)
    # a 0-d DTensor (a loss) is whole: hand it back as a plain tensor, wherever it is, with
    # its weight (NOTE [token weighting] in meshlm/core/weighting.py)
    return tree.map_tensors(out, lambda _p, t: _whole(t) if isinstance(t, DTensor) and t.ndim == 0 else t, strict=False)


def _whole(t: DTensor) -> Tensor:
    w = weighting.weight_tensor(t)
    out = t.full_tensor()
    return out if w is None else weighting.attach(out, w)
