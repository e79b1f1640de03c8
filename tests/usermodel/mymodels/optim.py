"""A user's optimizer, outside meshlm: ``meshlm train optim._target_=mymodels.optim.SignMomentum``.

``p -= lr * sign(m)``, ``m = beta * m + g``: elementwise, but not one of torch's, so
``ShardedOptimizer`` steps each parameter whole (NOTE [whole-tensor step])."""

from __future__ import annotations

import torch


class SignMomentum(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                m = st.setdefault("momentum", torch.zeros_like(p))
                m.mul_(group["beta"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * torch.sign(m))
