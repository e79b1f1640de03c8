"""Optimizers that need each parameter whole (NOTE [whole-tensor step] in meshlm/runtime/optim/chunks.py):
torch's Adafactor and a matrix optimizer written here (an update normalised by the whole
gradient's norm, wrong on any shard of it) step the same parameters as on one device,
bit for bit, under layouts that shard storage (fsdp, tp), optimizer state (zero1, zero2)
or neither (ddp).

The gradients are set, not computed: the same tensor on both sides, of small dyadic values
(every sum of them exact), so any difference comes from the step alone and the check can
be exact.  Three steps, 2 gloo processes.
"""

import pytest
import torch

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=60)

CASES = [
    ("ddp", "dp=2"),
    ("zero1", "dp=2"),
    ("zero2", "fsdp=2"),
    ("fsdp", "fsdp=2"),
    ("tp", "tp=2"),
    ("fsdp_tp", "fsdp=2"),
]


class NormalizedSGD(torch.optim.Optimizer):
    """``p -= lr * g / ||g||`` per parameter: the norm is of the whole gradient."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / p.grad.norm() * group["lr"])


OPTIMIZERS = {
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "normalized_sgd": (NormalizedSGD, {"lr": 0.1}),
}


def _job(layout: str, mesh_shape: str, name: str):
    from torch.distributed.tensor import distribute_tensor

    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    cls, kw = OPTIMIZERS[name]
    cfg = llama_config("llama_tiny", vocab=64, embed=16, heads=2, kv_heads=2, mlp=32, layers=2)
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=1)
    ref = Llama(cfg, seed=1)
    opt, ref_opt = ShardedOptimizer(model, cls, **kw), cls(ref.parameters(), **kw)
    mine, refp = dict(model.named_parameters()), dict(ref.named_parameters())
    gen = torch.Generator().manual_seed(2)
    bad = []
    for step in range(3):
        for n, r in refp.items():
            g = torch.randint(-16, 17, r.shape, generator=gen).float() / 64
            r.grad = g.clone()
            mine[n].grad = distribute_tensor(g.clone(), mesh, mine[n].placements)
        opt.step()
        ref_opt.step()
        bad += [f"step {step}: {n}" for n, r in refp.items() if not torch.equal(mine[n].full_tensor(), r.detach())]
        opt.zero_grad()
        ref_opt.zero_grad()
    return bad


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout,mesh", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_whole_tensor_optimizer_steps_as_one_device(pool2, layout, mesh, name):
    for bad in pool2.run(_job, layout, mesh, name):
        assert bad == [], f"{name} under {layout} on {mesh}: parameters differ from one device: {bad[:5]}"
