"""A mixture-of-experts feed-forward layer written once against logical axes.

NOTE [moe routing]
    ``MoE`` replaces a SwiGLU MLP by ``experts`` SwiGLU experts of width ``mlp`` each and a
    router.  Per token:

    - the router's logits ``x @ router.T`` are computed in float32 whatever the model's dtype,
      and ``probs = softmax(logits)`` over the experts;
    - each token picks its ``top_k`` experts by ``probs + selection_bias`` (the bias, a
      buffer that starts at zero, moves only which experts are picked: DeepSeek-V3's
      aux-loss-free balancing); its gates are those experts' ``probs``, renormalised to sum
      to one with ``norm_topk`` (Mixtral, Qwen3-MoE) or not (Qwen2-MoE);
    - its output is ``sum_k gate_k * expert_k(x)``, plus the shared expert's ``(x)`` if
      ``shared_mlp > 0`` (times ``sigmoid(shared_gate . x)`` with ``shared_gate``).

    Token group.  Routing is decided per *sequence*: each row of the batch is one group, and
    its tokens fill each expert's ``capacity`` slots first choices first (every token's
    first choice, in position order, then every second choice, ...: GShard's priority).  A
    (token, expert) pair past the capacity is dropped: the token gets nothing from that
    expert (its other choices and the residual stream still carry it), as in Switch and
    GShard.  ``capacity_factor=None`` is dropless: the capacity is the sequence length, which
    no expert can exceed, since a token picks an expert at most once.  Otherwise the capacity
    is ``ceil(capacity_factor * top_k * seq / experts)``.  A sequence is never split inside
    the layer under any layout (its input is constrained with the sequence whole), so the
    group, the capacity, which pairs are dropped, the load-balancing loss and the token
    counts are those of one device under every layout, data, tensor and expert parallel.

    Experts run as one batched matmul over the expert dim: the tokens are placed in a
    ``(batch, experts, capacity, embed)`` buffer (a dense dispatch einsum, GShard's), each
    expert multiplies its own slots (``einsum("becd,emd->becm")``, a ``bmm`` over experts),
    and the outputs are combined back with the gates.  Slots no token fills are zeros and
    cost their share of the matmul (a padded batched matmul; ``torch._grouped_mm``, which
    would skip them, does not run on CPU in torch 2.13).  An expert that gets no token in a
    step gets an exact zero gradient, on one device and under every layout alike.

    Expert parallelism is a layout, not code: the buffer is constrained to ``("batch",
    "experts", None, "embed")``, so a layout that maps ``experts: ep`` and ``batch: [...,
    ep]`` turns that constraint into an all-to-all over ``ep`` (``batch`` yields ``ep`` to
    ``experts``: NOTE [sequence yields] in meshlm/layout/rules.py), each ep rank runs its own
    experts on every rank's tokens, and the constraint back to ``("batch", None, None,
    "embed")`` is the all-to-all that returns them.

    Auxiliary losses, per sequence as the routing is: the load-balancing loss
    ``experts * sum_e f_e * P_e`` (Switch; ``f_e`` the fraction of the sequence's top-k picks
    that went to expert e before any drop, ``P_e`` its mean router probability) and the
    router z-loss ``mean over tokens of logsumexp(logits)^2`` (ST-MoE), weighted by
    ``balance_loss`` and ``z_loss``.  ``forward`` returns them per row, ``(batch,)``; a model
    adds their mean over the batch to its loss (meshlm/models/moe.py).  The router logits,
    the per-row aux losses and the per-row token counts of each expert pass through
    ``constrain`` (``("batch", None, None)``, ``("batch",)``, ``("batch", None)``), where
    ``meshlm.core.annotate.observing`` sees them.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core.annotate import constrain
from meshlm.core.axes import Axes
from meshlm.core.errors import ConfigError
from meshlm.core.moe_experts import experts
from meshlm.core.rowwise import rowwise

__all__ = ["MoE", "capacity", "route"]


def capacity(seq: int, experts: int, top_k: int, capacity_factor: Optional[float]) -> int:
    """Slots per expert for one sequence of ``seq`` tokens (NOTE [moe routing]): ``seq``
    when dropless (``capacity_factor`` None), else ``ceil(capacity_factor * top_k * seq /
    experts)``, at most ``seq``."""
    if capacity_factor is None:
        return seq
    return max(1, min(seq, math.ceil(capacity_factor * top_k * seq / experts)))


def route(logits: Tensor, top_k: int, cap: int, norm_topk: bool = True, bias: Optional[Tensor] = None):
    """Routing of each row's tokens (NOTE [moe routing]).  ``logits``: float32 ``(batch,
    seq, experts)``.  Returns ``(dispatch, combine, picks, kept)``: the 0/1 dispatch and
    the gate-weighted combine tensors ``(batch, seq, experts, cap)``, the count of top-k
    picks per row and expert before drops and of the (token, expert) pairs kept ``(batch,
    experts)``."""
    e = logits.shape[-1]
    probs = logits.softmax(-1)
    chosen = probs if bias is None else probs + bias.to(probs.dtype)
    idx = chosen.topk(top_k, dim=-1).indices  # (b, s, k)
    gates = probs.gather(-1, idx)
    if norm_topk:
        gates = gates / gates.sum(-1, keepdim=True)
    pick = F.one_hot(idx, e).to(probs.dtype)  # (b, s, k, e)
    # the slot of each pick in its expert's buffer: first choices of the whole row first
    order = pick.transpose(1, 2).flatten(1, 2)  # (b, k*s, e), choice-major
    slot = ((order.cumsum(1) - 1) * order).sum(-1)  # (b, k*s)
    slot = slot.unflatten(1, (top_k, -1)).transpose(1, 2)  # (b, s, k)
    keep = (slot < cap).to(probs.dtype)
    at = F.one_hot(slot.clamp(max=cap - 1).long(), cap).to(probs.dtype)  # (b, s, k, cap)
    kept_pick = pick * keep[..., None]
    dispatch = torch.einsum("bske,bskc->bsec", kept_pick, at)
    combine = torch.einsum("bske,bskc->bsec", kept_pick * gates[..., None], at)
    return dispatch, combine, pick.sum((1, 2)), kept_pick.sum((1, 2))


def _combine(combine: Tensor, ye: Tensor) -> Tensor:
    """The experts' outputs back to their tokens, gate-weighted: ``(batch, seq, embed)``."""
    return torch.einsum("bsec,becd->bsd", combine.to(ye.dtype), ye)


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU feed-forward layer: embed -> top-k of ``experts`` experts
    (each embed -> ``mlp`` -> embed) -> embed, with an optional shared expert (NOTE [moe
    routing]).  ``forward(x)`` with ``x: (batch, seq, embed)`` returns ``(y, aux)``: ``y``
    like ``x``, ``aux: (batch,)`` each row's weighted auxiliary loss (zeros when both weights
    are 0).

    Parameters (checkpoint keys): ``router (experts, embed)``; ``w_gate``, ``w_up``
    ``(experts, mlp, embed)`` and ``w_down (experts, embed, mlp)``: the experts stacked;
    with ``shared_mlp``: ``shared_gate_proj``, ``shared_up`` ``(shared_mlp, embed)``,
    ``shared_down (embed, shared_mlp)`` and, with ``shared_gate``, ``shared_gate (1,
    embed)``.  Buffer ``selection_bias (experts,)``."""

    param_axes: ClassVar[dict[str, Axes]] = {
        "router": (None, "embed"),
        "w_gate": ("experts", "mlp", "embed"),
        "w_up": ("experts", "mlp", "embed"),
        "w_down": ("experts", "embed", "mlp"),
        "shared_gate_proj": ("mlp", "embed"),
        "shared_up": ("mlp", "embed"),
        "shared_down": ("embed", "mlp"),
        "shared_gate": (None, "embed"),
    }

    def __init__(
        self,
        embed: int,
        mlp: int,
        experts: int,
        top_k: int = 2,
        *,
        shared_mlp: int = 0,
        shared_gate: bool = False,
        capacity_factor: Optional[float] = None,
        norm_topk: bool = True,
        balance_loss: float = 0.0,
        z_loss: float = 0.0,
        init_std: float = 0.02,
        out_std: Optional[float] = None,
        device=None,
    ):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ConfigError(f"MoE: top_k={top_k} must be between 1 and experts={experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ConfigError(f"MoE: capacity_factor={capacity_factor} must be positive (or None: dropless)")
        if shared_gate and shared_mlp <= 0:
            raise ConfigError("MoE: shared_gate=True needs a shared expert (shared_mlp > 0)")
        self.experts, self.top_k = experts, top_k
        self.capacity_factor, self.norm_topk = capacity_factor, norm_topk
        self.balance_loss, self.z_loss = balance_loss, z_loss
        self.init_std = init_std
        self.out_std = init_std if out_std is None else out_std
        self.router = nn.Parameter(torch.empty(experts, embed, device=device))
        self.w_gate = nn.Parameter(torch.empty(experts, mlp, embed, device=device))
        self.w_up = nn.Parameter(torch.empty(experts, mlp, embed, device=device))
        self.w_down = nn.Parameter(torch.empty(experts, embed, mlp, device=device))
        self.shared_mlp = shared_mlp
        if shared_mlp:
            self.shared_gate_proj = nn.Parameter(torch.empty(shared_mlp, embed, device=device))
            self.shared_up = nn.Parameter(torch.empty(shared_mlp, embed, device=device))
            self.shared_down = nn.Parameter(torch.empty(embed, shared_mlp, device=device))
        self.shared_gate = nn.Parameter(torch.empty(1, embed, device=device)) if shared_gate else None
        self.register_buffer("selection_bias", torch.zeros(experts, device=device))

    def init_weights(self, gen: torch.Generator) -> None:
        for w in (self.router, self.w_gate, self.w_up):
            nn.init.normal_(w, std=self.init_std, generator=gen)
        nn.init.normal_(self.w_down, std=self.out_std, generator=gen)
        if self.shared_mlp:
            nn.init.normal_(self.shared_gate_proj, std=self.init_std, generator=gen)
            nn.init.normal_(self.shared_up, std=self.init_std, generator=gen)
            nn.init.normal_(self.shared_down, std=self.out_std, generator=gen)
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate, std=self.init_std, generator=gen)
        nn.init.zeros_(self.selection_bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # x: (batch, seq, embed)
        x = constrain(x, ("batch", None, "embed"))  # each sequence whole: the routing group
        cap = capacity(x.shape[1], self.experts, self.top_k, self.capacity_factor)
        # routing and dispatch, then the combine, on this rank's rows (NOTE [rowwise])
        logits, combine, kept, aux, xe = rowwise(self._dispatch, x, self.router, self.selection_bias, cap)
        logits = constrain(logits, ("batch", None, None))
        constrain(kept, ("batch", None))
        xe = constrain(xe, ("batch", "experts", None, "embed"))  # to the experts' ranks
        ye = experts(xe, self.w_gate, self.w_up, self.w_down)  # NOTE [local experts]
        ye = constrain(ye, ("batch", None, None, "embed"))  # back to the tokens' ranks
        y = rowwise(_combine, combine, ye)
        if self.shared_mlp:
            hs = F.silu(F.linear(x, self.shared_gate_proj)) * F.linear(x, self.shared_up)
            hs = constrain(hs, ("batch", None, "mlp"))
            ys = F.linear(hs, self.shared_down)
            if self.shared_gate is not None:
                ys = ys * torch.sigmoid(F.linear(x, self.shared_gate))
            y = y + ys
        aux = constrain(aux, ("batch",))
        return constrain(y, ("batch", "seq", "embed")), aux

    def _dispatch(self, x: Tensor, router: Tensor, bias: Tensor, cap: int):
        """Each row's routing (NOTE [moe routing]): ``(logits, combine, kept, aux, xe)``, the
        float32 router logits, the combine tensor, the kept pairs per expert, the weighted
        auxiliary losses and the experts' buffer ``(batch, experts, cap, embed)``."""
        logits = F.linear(x.float(), router.float())
        dispatch, combine, picks, kept = route(logits, self.top_k, cap, self.norm_topk, bias)
        xe = torch.einsum("bsec,bsd->becd", dispatch.to(x.dtype), x)
        return logits, combine, kept, self.aux_losses(logits, picks), xe

    def aux_losses(self, logits: Tensor, picks: Tensor) -> Tensor:
        """Each row's ``balance_loss * load-balancing loss + z_loss * router z-loss``
        (NOTE [moe routing]), float32 ``(batch,)``."""
        aux = torch.zeros_like(logits[:, 0, 0])
        if self.balance_loss:
            frac = picks / (logits.shape[1] * self.top_k)  # (b, e)
            mean_prob = logits.softmax(-1).mean(1)  # (b, e)
            aux = aux + self.balance_loss * self.experts * (frac * mean_prob).sum(-1)
        if self.z_loss:
            aux = aux + self.z_loss * torch.logsumexp(logits, -1).pow(2).mean(1)
        return aux
