"""Parity of every shipped layout against one device: loss, every gradient, the AdamW step.

Meshes of 2 and 4 gloo processes, 1-D and 2-D; the same under torch.compile (aot_eager for
every layout, inductor for one).  The checks run inside the workers
(meshlm.testing.parity.check_step); tolerances and their justification are in
meshlm/testing/tolerances.py.
"""

import pytest

from meshlm.testing import dist_pool_fixture
from meshlm.testing.parity import check_step

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

EAGER_2 = [
    ("single", "dp=2"), ("ddp", "dp=2"), ("zero1", "dp=2"), ("zero2", "fsdp=2"), ("fsdp", "fsdp=2"),
    ("hsdp", "fsdp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"), ("fsdp_tp", "fsdp=2"), ("fsdp_tp_sp", "tp=2"),
]
EAGER_4 = [
    ("ddp", "dp=4"), ("zero1", "dp=2,fsdp=2"), ("zero2", "dp=4"), ("fsdp", "fsdp=4"), ("fsdp", "dp=2,fsdp=2"),
    ("hsdp", "dp=2,fsdp=2"), ("tp", "tp=4"), ("tp", "dp=2,tp=2"), ("tp_sp", "tp=4"), ("tp_sp", "fsdp=2,tp=2"),
    ("fsdp_tp", "fsdp=2,tp=2"), ("fsdp_tp_sp", "fsdp=2,tp=2"),
]
COMPILED_4 = [
    ("ddp", "dp=4"), ("zero1", "dp=4"), ("zero2", "dp=4"), ("fsdp", "fsdp=4"), ("hsdp", "dp=2,fsdp=2"),
    ("tp", "tp=4"), ("tp_sp", "tp=4"), ("fsdp_tp", "fsdp=2,tp=2"), ("fsdp_tp_sp", "fsdp=2,tp=2"),
]


def _ok(res):
    for r in res:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
    assert len({r["loss"] for r in res}) == 1, "ranks disagree on the loss"


@pytest.mark.parametrize("compile", [None, "aot_eager"])
@pytest.mark.parametrize("layout", ["single", "fsdp", "tp_sp"])
def test_parity_one_device(pool1, layout, compile):
    """On a one-device mesh every layout's blocks run on local tensors (NOTE [local blocks]
    in meshlm/bucket.py), eager and compiled."""
    _ok(pool1.run(check_step, layout, "dp=1", compile=compile))


@pytest.mark.parametrize("layout,mesh", EAGER_2, ids=[f"{l}-{m}" for l, m in EAGER_2])
def test_parity_2(pool2, layout, mesh):
    _ok(pool2.run(check_step, layout, mesh))


@pytest.mark.parametrize("layout,mesh", EAGER_4, ids=[f"{l}-{m}" for l, m in EAGER_4])
def test_parity_4(pool4, layout, mesh):
    _ok(pool4.run(check_step, layout, mesh))


@pytest.mark.parametrize("layout,mesh", COMPILED_4, ids=[f"{l}-{m}" for l, m in COMPILED_4])
def test_parity_compiled_aot_eager(pool4, layout, mesh):
    _ok(pool4.run(check_step, layout, mesh, compile="aot_eager"))


def test_parity_compiled_inductor(pool2):
    _ok(pool2.run(check_step, "tp_sp", "tp=2", compile="inductor"))


@pytest.mark.parametrize("layout,mesh", [("ddp", "dp=4"), ("hsdp", "dp=2,fsdp=2"), ("fsdp_tp_sp", "fsdp=2,tp=2")])
def test_parity_overlapped_reduction(pool4, layout, mesh):
    """Gradient reductions left in flight through backward (NOTE [overlapped reduction] in
    meshlm/bucket.py; the default on CUDA) give the same gradients, settled as plain tensors."""
    _ok(pool4.run(check_step, layout, mesh, overlap=True))


@pytest.mark.parametrize("layout,mesh", [("tp", "tp=4"), ("fsdp_tp_sp", "fsdp=2,tp=2")])
def test_parity_tied_embeddings(pool4, layout, mesh):
    """A vocab-sharded table used by both F.embedding and the output F.linear."""
    _ok(pool4.run(check_step, layout, mesh, tie_embeddings=True))



def _dynamo_graphs(layout, mesh):
    """How many graphs Dynamo compiles for llama_tiny's blocks over two training steps."""
    import torch

    import meshlm
    from meshlm.compile import compile_blocks
    from meshlm.models import Llama, llama_config
    from meshlm.optim import ShardedOptimizer

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, counting the graphs Dynamo hands it
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        graphs.append(gm)
        boxed = lambda g, _inputs: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    cfg = llama_config("llama_tiny")
    m = meshlm.make_mesh(mesh)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, m)
    compile_blocks(model, backend=backend)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    toks = torch.randint(0, cfg.vocab, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = meshlm.shard_batch(toks[:, :-1], layout, m), meshlm.shard_batch(toks[:, 1:], layout, m)
    for _ in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return len(graphs)


@pytest.mark.parametrize("layout,mesh", [("fsdp", "fsdp=4"), ("fsdp_tp_sp", "fsdp=2,tp=2")])
def test_one_compiled_graph_per_block_class(pool4, layout, mesh):
    """Every layer shares one bucket and one block spec, so Dynamo compiles the block once,
    not once per layer (llama_tiny has 2)."""
    assert pool4.run(_dynamo_graphs, layout, mesh) == [1, 1, 1, 1]
