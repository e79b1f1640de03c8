"""What a plan says about a mixture of experts (NOTE [moe routing] in meshlm/core/moe.py):
the experts' share of each rank's parameters, the parameters one token uses, and the
all-to-all bytes of expert parallelism from the routing's formula.

NOTE [planned experts]
    For a model with ``meshlm.nn.MoE`` layers, the measured plan adds:

    - ``total`` and ``active`` parameters: every parameter, and those one token uses (its
      ``top_k`` of each layer's ``experts``, the rest of the model whole).  Training FLOPs
      go as the active ones; the measured FLOPs count what runs, every capacity slot of the
      padded expert matmul and the dense dispatch included;
    - ``expert_bytes``: the storage of this rank's share of the experts (``experts`` over ep,
      the rest of each expert over whatever the layout's ``params`` map: fsdp, tp);
    - the all-to-all of expert parallelism, where the layout maps ``experts`` to a mesh axis
      that also splits ``batch``: two per MoE layer and micro-batch in forward (to the
      experts and back) and two in backward, each of this rank's share of the token buffer,
      ``rows x experts x capacity x embed x bytes``, with ``rows`` the micro-batch's rows over
      every mesh axis that splits ``batch`` and ``capacity`` the per-sequence capacity
      (``meshlm.core.moe.capacity``; the sequence length when dropless, so dropless plans its
      worst case, which the padded buffer always moves).  The counted collectives of the
      measured step must equal it (tests/fake/test_plan_moe.py).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from meshlm.core.annotate import param_axes_of
from meshlm.core.moe import MoE, capacity
from meshlm.runtime.memory import local_data

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def expert_summary(
    model: nn.Module, compute: Mapping, sizes: Mapping[str, int], micro: int, seq: int, dtype=None
) -> dict:
    """NOTE [planned experts] for ``model`` (sharded, on fake tensors) under a layout whose
    compute rules are ``compute`` on a mesh of ``sizes``, activations of ``dtype`` (None: the
    parameters'); {} for a model without MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {}
    total = sum(p.numel() for p in model.parameters())
    unused = sum(getattr(m, n).numel() * (m.experts - m.top_k) // m.experts for m in layers for n in EXPERT_PARAMS)
    expert_bytes = 0
    for m in layers:
        assert param_axes_of(m)["w_up"][0] == "experts"
        for n in EXPERT_PARAMS:
            t = local_data(m._parameters[n])
            expert_bytes += t.numel() * t.element_size()
    live = {a for a, n in sizes.items() if n > 1}
    ep = [a for a in compute.get("experts", ()) if a in live and a in compute.get("batch", ())]
    rows = micro
    for a in compute.get("batch", ()):
        rows //= sizes.get(a, 1) if a in live else 1
    one = 0
    m0 = layers[0]
    if ep:
        embed = m0.router.shape[1]
        item = (
            torch.empty((), dtype=dtype) if dtype is not None else local_data(m0._parameters["w_up"])
        ).element_size()
        one = rows * m0.experts * capacity(seq, m0.experts, m0.top_k, m0.capacity_factor) * embed * item
    return {
        "layers": len(layers),
        "experts": m0.experts,
        "top_k": m0.top_k,
        "total": total,
        "active": total - unused,
        "expert_bytes": expert_bytes,
        "ep_axes": tuple(ep),
        "all_to_all_bytes": one,  # one buffer's move, per rank (0: no expert parallel)
        "all_to_all_count": 2 * len(layers) if ep else 0,  # per micro-batch and direction (forward, backward)
    }
