"""The context-parallel attention kernels as two custom operators, so that a compiled block
records each as one opaque call (its collectives run eagerly inside it) instead of tracing
their point-to-point sends.

NOTE [cp ops]
    ``torch.compile`` traces a block through DTensor's dispatch down to the local tensors;
    there the ring's isend/irecv on fake tensors cannot be traced.  ``meshlm::cp_attention``
    and ``meshlm::cp_attention_backward`` take the local tensors and the cp group's name and
    return what ``cp_attention_forward`` / ``cp_attention_backward`` (ring.py) return; their
    fake implementations give the shapes only.  Autograd is not involved: DTensor's handlers
    for CPU flash attention and its backward call the two ops (NOTE [cp dispatch] in
    meshlm/_torch_compat/dtensor_cp.py), and autograd sees only the aten ops.  meshlm.plan's
    fake step is eager (NOTE [fake eager] in meshlm/core/state.py): there the kernels run on
    the fake tensors themselves, so the planner counts their sends, receives and gathers and
    holds their buffers in its peak as a real step would.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.state import eager
from meshlm.runtime.cp.ring import cp_attention_backward, cp_attention_forward


@torch.library.custom_op("meshlm::cp_attention", mutates_args=())
def cp_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group: str, causal: bool, balanced: bool, scale: Optional[float], variant: str
) -> tuple[Tensor, Tensor]:
    out, lse = cp_attention_forward(
        q,
        k,
        v,
        group=compat.resolve_process_group(group),
        causal=causal,
        balanced=balanced,
        scale=scale,
        variant=variant,
    )
    return out.contiguous(), lse.contiguous()


@cp_attention_op.register_fake
def _(q, k, v, group, causal, balanced, scale, variant):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("meshlm::cp_attention_backward", mutates_args=())
def cp_attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: str,
    causal: bool,
    balanced: bool,
    scale: Optional[float],
    variant: str,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = cp_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        group=compat.resolve_process_group(group),
        causal=causal,
        balanced=balanced,
        scale=scale,
        variant=variant,
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@cp_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, group, causal, balanced, scale, variant):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _traced() -> bool:
    """A trace is running (Dynamo's or AOTAutograd's, on fake tensors): the ops go in the
    graph; eagerly (the planner's fake step included) the kernels run directly, their
    collectives in sight of CommCounter."""
    return not eager()


def forward(q, k, v, *, group, causal, balanced, scale, variant):
    """``cp_attention_forward``'s signature, through the custom op when traced (``group``: a
    ProcessGroup)."""
    if not _traced():
        out, lse = cp_attention_forward(
            q, k, v, group=group, causal=causal, balanced=balanced, scale=scale, variant=variant
        )
        return out.contiguous(), lse.contiguous()
    return cp_attention_op(q, k, v, group.group_name, causal, balanced, scale, variant)


def backward(dout, q, k, v, out, lse, *, group, causal, balanced, scale, variant):
    """``cp_attention_backward``'s signature, through the custom op when traced."""
    if not _traced():
        return cp_attention_backward(
            dout, q, k, v, out, lse, group=group, causal=causal, balanced=balanced, scale=scale, variant=variant
        )
    return cp_attention_backward_op(dout, q, k, v, out, lse, group.group_name, causal, balanced, scale, variant)
