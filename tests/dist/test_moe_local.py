"""The MoE layer's routing, dispatch, experts and combine run on local tensors under layouts
that split it by rows, experts or hidden units (NOTE [rowwise] in meshlm/core/rowwise.py,
NOTE [local experts] in meshlm/core/moe_experts.py): no einsum of the layer sees a DTensor,
and the layer's output and every gradient equal plain torch's on one process (the MoE layer
run on the whole batch with the same weights), dropless and with capacity routing."""

from __future__ import annotations

import pytest

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=60)

AXES = {"batch", "embed", "mlp", "experts"}


def _layout(name: str):
    from pathlib import Path

    import yaml

    from meshlm.layout.rules import parse_layout

    path = Path(__file__).resolve().parents[2] / "layouts" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    data = {sec: {a: m for a, m in rules.items() if a in AXES} for sec, rules in data.items()}
    return parse_layout(data, name=name, source=str(path))


def _run(layout: str, mesh_shape: str, capacity_factor):
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    import meshlm
    from meshlm.core.annotate import constrain, reduce_batch
    from meshlm.core.moe import MoE

    class Stack(nn.Module):
        param_axes: dict = {}

        def __init__(self, device=None):
            super().__init__()
            self.moe = MoE(32, 24, 4, 2, capacity_factor=capacity_factor, device=device)

        def init_weights(self, gen):
            pass

        def forward(self, x, w):
            x = constrain(x, ("batch", None, "embed"))
            return reduce_batch((self.moe(x)[0] * w).sum() / x.shape[0], "mean")

    class Einsums(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.einsum:
                self.seen.append(any(isinstance(a, DTensor) for a in tree_leaves(args)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, 32, generator=g)
    mesh = meshlm.make_mesh(mesh_shape)
    lay = _layout(layout)
    model = meshlm.shard(Stack(device="meta"), lay, mesh, seed=0)
    ref = Stack()

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    ref.load_state_dict({n: whole(p) for n, p in model.state_dict().items()})
    with Einsums() as mode:
        loss = model(*meshlm.shard_batch((x, w), lay, mesh))
    loss.backward()
    ref_loss = ref(x, w)
    ref_loss.backward()
    grads = {n: (whole(p.grad), dict(ref.named_parameters())[n].grad) for n, p in model.named_parameters()}
    return mode.seen, float(whole(loss)), float(ref_loss), grads


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
@pytest.mark.parametrize("layout,mesh", [("fsdp_ep", "ep=2"), ("tp", "tp=2")])
def test_moe_layer_runs_local_and_matches_one_process(pool2, layout, mesh, capacity_factor):
    import torch

    for seen, loss, ref_loss, grads in pool2.run(_run, layout, mesh, capacity_factor):
        assert seen and not any(seen), f"{sum(seen)} of {len(seen)} einsums ran on DTensors"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for name, (got, want) in grads.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _a2a_peaks():
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    import meshlm
    from harness.memory import PeakStorage

    mesh = meshlm.make_mesh("ep=2")
    full = torch.randn(4, 6, 5, 8, generator=torch.Generator().manual_seed(0))
    out = {}
    for src, dst in ((0, 1), (1, 0)):
        x = distribute_tensor(full, mesh, [Shard(src)])
        local = x.to_local()
        mem = PeakStorage([local])
        with mem:
            y = x.redistribute(mesh, [Shard(dst)])
        want = torch.chunk(full, 2, dim=dst)[mesh.get_local_rank()]
        out[(src, dst)] = (mem.peak - mem.backend_slack, local.nbytes, torch.equal(y.to_local(), want))
    return out


def test_expert_all_to_all_holds_one_buffer_fewer(pool2):
    """NOTE [a2a copies] in meshlm/_torch_compat/dtensor_alltoall.py: each way, the move
    holds three buffers of the local share at its peak, not four: the dispatch (rows ->
    experts) its input, the send buffer and the received one, whose concatenation along
    rows is a view; the return (experts -> rows) sends a view of its input and holds the
    received buffer and their concatenation.  Each result equals plain torch's chunk of
    the whole tensor."""
    for got in pool2.run(_a2a_peaks):
        (to_experts, n, ok1), (to_rows, _, ok2) = got[(0, 1)], got[(1, 0)]
        assert ok1 and ok2
        assert to_experts <= 3 * n, (to_experts / n, got)
        assert to_rows <= 3 * n, (to_rows / n, got)
