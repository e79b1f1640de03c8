"""meshlm.nn.MoE against a plain-torch reference written here: a loop over tokens and their
chosen experts, capacity filled first choices first within each sequence (NOTE [moe
routing] in meshlm/core/moe.py), the Switch load-balancing loss and the router z-loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.moe import MoE


def _swiglu(x, wg, wu, wd):
    return (F.silu(wg @ x) * (wu @ x)) @ wd.T


def reference(m: MoE, x: torch.Tensor):
    """(y, aux, kept counts) of ``m`` on ``x`` (batch, seq, embed), token by token."""
    b, s, _ = x.shape
    e, k = m.experts, m.top_k
    cap = s if m.capacity_factor is None else max(1, min(s, math.ceil(m.capacity_factor * k * s / e)))
    ys, auxes, counts = [], [], []
    for r in range(b):
        logits = x[r].float() @ m.router.float().T  # (s, e)
        probs = logits.softmax(-1)
        idx = (probs + m.selection_bias).topk(k, -1).indices
        gates = probs.gather(-1, idx)
        if m.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        fill = [0] * e
        keep = torch.zeros(s, k, dtype=torch.bool)
        for j in range(k):  # first choices of the whole sequence first
            for t in range(s):
                ex = int(idx[t, j])
                if fill[ex] < cap:
                    fill[ex] += 1
                    keep[t, j] = True
        rows = []
        for t in range(s):
            out = torch.zeros_like(x[r, t])
            for j in range(k):
                if keep[t, j]:
                    ex = int(idx[t, j])
                    out = out + gates[t, j].to(x.dtype) * _swiglu(x[r, t], m.w_gate[ex], m.w_up[ex], m.w_down[ex])
            if m.shared_mlp:
                sh = _swiglu(x[r, t], m.shared_gate_proj, m.shared_up, m.shared_down)
                if m.shared_gate is not None:
                    sh = sh * torch.sigmoid(m.shared_gate[0] @ x[r, t])
                out = out + sh
            rows.append(out)
        ys.append(torch.stack(rows))
        picks = F.one_hot(idx, e).sum((0, 1)).float()
        bal = e * ((picks / (s * k)) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        auxes.append(m.balance_loss * bal + m.z_loss * z)
        counts.append(torch.tensor(fill, dtype=torch.float32))
    return torch.stack(ys), torch.stack(auxes), torch.stack(counts)


def _layer(**kw):
    torch.manual_seed(0)
    m = MoE(16, 12, kw.pop("experts", 4), kw.pop("top_k", 2), init_std=0.3, **kw)
    from meshlm.core.annotate import init_params

    init_params(m, 0)
    return m


CASES = {
    "dropless": {},
    "capacity": {"capacity_factor": 0.5},
    "shared_gated": {"experts": 8, "top_k": 3, "shared_mlp": 8, "shared_gate": True, "capacity_factor": 1.0},
    "unnormalised": {"norm_topk": False, "balance_loss": 0.0, "z_loss": 0.0},
}


@pytest.mark.parametrize("case", CASES)
def test_moe_matches_token_loop(case):
    kw = {"balance_loss": 0.01, "z_loss": 0.001, **CASES[case]}
    m = _layer(**kw)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    seen = []
    from meshlm.core.annotate import observing

    with observing(lambda t, axes: seen.append((axes, t))):
        y, aux = m(x)
    ry, raux, rcount = reference(m, x)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, raux, rtol=1e-5, atol=1e-7)
    kept = [t for axes, t in seen if axes == ("batch", None)]
    torch.testing.assert_close(kept[0], rcount)
    if kw.get("capacity_factor") == 0.5:  # the case drops pairs: the capacity binds
        assert rcount.sum() < 3 * 10 * m.top_k
    # gradients of every parameter and of the input
    w = torch.randn_like(y)
    ((y * w).sum() + aux.sum()).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()} | {"x": x.grad.clone()}
    m.zero_grad()
    x.grad = None
    ry, raux, _ = reference(m, x)
    ((ry * w).sum() + raux.sum()).backward()
    want = {n: p.grad for n, p in m.named_parameters()} | {"x": x.grad}
    for n in want:  # sums of ~100 float32 terms in another order: 1e-5 of the tensor's scale
        atol = 1e-5 * float(want[n].abs().max())
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=atol, msg=lambda msg, n=n: f"grad {n}: {msg}")


def test_unused_experts_get_zero_gradient():
    """Experts the selection bias keeps every token from: an exact zero gradient."""
    m = _layer(experts=4, top_k=1)
    with torch.no_grad():
        m.selection_bias[2:] = -10.0
    y, aux = m(torch.randn(2, 6, 16))
    y.sum().backward()
    assert m.w_up.grad[2:].abs().max() == 0 and m.w_down.grad[2:].abs().max() == 0
    assert m.w_up.grad[:2].abs().max() > 0


def test_capacity_is_per_sequence():
    """A row's routing does not depend on the other rows: the token group is the sequence."""
    m = _layer(capacity_factor=0.5)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(3))
    y_pair, _ = m(x)
    y_alone, _ = m(x[:1])
    torch.testing.assert_close(y_pair[:1], y_alone, rtol=0, atol=1e-6)


def test_bad_config_is_clear():
    from meshlm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="top_k=5"):
        MoE(8, 8, 4, 5)
    with pytest.raises(ConfigError, match="capacity_factor"):
        MoE(8, 8, 4, 2, capacity_factor=0.0)
