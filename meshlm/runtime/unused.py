"""Parameters that get no gradient in a step: the optimizer skips them, as on one device.

NOTE [unused parameters]
    In plain torch a parameter that no backward of the step reached keeps ``grad is None``,
    and ``torch.optim`` skips it: no weight decay, no momentum, no moment update.  meshlm
    keeps that rule under every layout:

    - A parameter is *used* in a step if any backward of the step (any micro-batch) on any
      data-parallel rank gives it a gradient.  One device, which sees the whole batch, would
      have used it; so a parameter used on some ranks only is used, and its gradient is the
      sum of the ranks' gradients as always (zero from the ranks that did not use it).
    - A parameter no rank used gets ``grad = None`` on its master, and the torch optimizer
      skips it (``ShardedOptimizer.reduce_grads``, ``drop_unused``).
    - Under DTensor (any layout with tensor parallelism, or a block run on DTensors) every
      rank runs the same global program, so a parameter is unused on all ranks or on none;
      autograd leaves its gradient None (``bucket.Gather`` does not materialise zero
      gradients for outputs nothing used) and no communication is needed.
    - On local tensors (the data-parallel layouts' local blocks and local root: NOTE [local
      blocks] in meshlm/runtime/bucket/__init__.py, NOTE [local root] in lowering/local_root.py) a
      rank runs its own rows and may take another branch than its peers.  A bucket's
      reduction is one flat collective whose shape every rank must agree on, so a rank fills
      the gradient of a member it did not use with zeros (``mark_filled``) and marks the
      ones it did (``mark_used``).  At the step one all-reduce (max) of a byte per parameter
      over the data axes tells every rank which parameters some rank used; the rest have
      only zeros from every rank and are dropped.  That all-reduce is the one collective
      this rule adds, and only where local buckets reduce over more than one rank.
    - Limits: a parameter outside blocks that a ZeRO-3 layout (fsdp, hsdp) gathers at use
      is gathered by a collective at its use, so it must be used on every data-parallel
      rank or on none in a step (put data-dependent branches inside a ``@meshlm.block``,
      whose parameters are gathered at the block's entry); and a block must use at least
      one of its parameters on every rank that calls it, so that its backward runs there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshlm import _torch_compat as compat
from meshlm.core.axes import DATA_AXES

USED = "_meshlm_used"  # a real gradient reached this parameter on this rank in this step
FILLED = "_meshlm_filled"  # this rank reduced zeros for it (it did not use it)


def mark_used(p: Tensor) -> None:
    setattr(p, USED, True)


def mark_filled(p: Tensor) -> None:
    setattr(p, FILLED, True)


def used_here(p: Tensor) -> bool:
    """False where this rank only filled zeros for ``p`` in this step (then its gradient, if
    no other rank used it, is dropped); True otherwise, whatever its gradient is (one that
    never went through a filling bucket is None exactly when autograd gave it nothing)."""
    return getattr(p, USED, False) or not getattr(p, FILLED, False)


def reset(p: Tensor) -> None:
    """Forget this step's marks (``zero_grad``)."""
    for attr in (USED, FILLED):
        if hasattr(p, attr):
            delattr(p, attr)


def local_reductions(model, st) -> tuple[str, ...]:
    """The process groups over which ranks may disagree on which parameters they used: the
    data axes of size > 1 where the model has local blocks or a local root; () where every
    rank runs the same program (DTensor) or there is one rank."""
    from meshlm.core.annotate import outer_blocks

    local = st.root is not None or any(
        getattr(getattr(b, "_meshlm_block", None), "local", False) for b in outer_blocks(model)
    )
    if not local:
        return ()
    return tuple(
        st.mesh.get_group(i).group_name for i, name in enumerate(st.names) if name in DATA_AXES and st.sizes[name] > 1
    )


def used_anywhere(flags: list[bool], groups: tuple[str, ...], device) -> list[bool]:
    """``flags`` (this rank's, one per parameter) or-ed over ``groups``: one all-reduce of a
    byte per parameter per group."""
    if not groups or not flags:
        return flags
    t = torch.tensor(flags, dtype=torch.uint8, device=device)
    for g in groups:
        t = compat.all_reduce(t, "max", g)
        if compat.in_flight(t):
            t = t.wait()
    if compat.fake_mode_active():  # a planner's fake step counts the collective; it has no values
        return flags
    return [bool(v) for v in t.tolist()]
