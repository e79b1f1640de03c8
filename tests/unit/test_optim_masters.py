"""What ``ShardedOptimizer`` steps on, per parameter (module docstring of meshlm/runtime/optim/sharded.py), on
a fake process group (shapes, placements, dtypes and storage; the only values compared are
this rank's own, which no collective produces):

- a parameter stored as the optimizer wants it is its own master (no copy);
- ZeRO-1/2's same-dtype master is a view of this rank's block of the parameter's storage
  (NOTE [optimizer chunks]); under bf16 training (``train_dtypes``: bf16 storage with
  float32 main gradients) it is a float32 copy of that block;
- every master is in the layout's optimizer placements, the parameter's shape;
- frozen parameters are left out, whatever their place in the model;
- elementwise optimizers step on local tensors (NOTE [local step]), others on replicated
  masters (NOTE [whole-tensor step]);
- ``bucket_mb`` is any positive number of MiB (2**20 bytes).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import meshlm
from meshlm.layout.mesh import init_fake
from meshlm.layout.precision import train_dtypes
from meshlm.models import Llama, llama_config
from meshlm.runtime.lowering import local_box, placements, shard_state
from meshlm.runtime.optim.sharded import ShardedOptimizer

CFG = llama_config("llama_tiny", vocab=64, embed=16, heads=2, kv_heads=2, mlp=32, layers=1)
MESH = {"ddp": {"dp": 2}, "zero1": {"dp": 2}, "zero2": {"fsdp": 2}, "fsdp": {"fsdp": 2}, "tp": {"tp": 2}}


@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(layout: str, source: str = "seed", dtype=None, rank: int = 1, shard_kw: dict | None = None):
    """``source``: "seed" (built on meta, drawn shard by shard), "weights" (float32 weights
    given), "bf16 weights" (weights given in bf16, as a bf16 checkpoint loads).  ``dtype``:
    shard as ``meshlm train`` does for that ``train.param_dtype``; ``shard_kw``: these
    ``meshlm.shard`` arguments instead."""
    init_fake(2, rank=rank)  # rank 1: its blocks start past 0
    mesh = meshlm.make_mesh(MESH[layout], fake=True)
    model = Llama(CFG, device="meta") if source == "seed" else Llama(CFG, seed=0)
    if source == "bf16 weights":
        model = model.to(torch.bfloat16)
    kw = train_dtypes(dtype, None, meshlm.load_layout(layout), MESH[layout]) if dtype else {}
    kw = kw if shard_kw is None else shard_kw
    return meshlm.shard(model, layout, mesh, **kw), mesh


def _block(p: DTensor, mesh, pl) -> torch.Tensor:
    """This rank's block under ``pl`` of a parameter stored whole where ``pl`` splits it."""
    local = p._local_tensor
    for d, ((s0, _n), (o0, on)) in enumerate(zip(local_box(p.shape, mesh, p.placements), local_box(p.shape, mesh, pl))):
        local = local.narrow(d, o0 - s0, on)
    return local


@pytest.mark.parametrize("layout", sorted(MESH))
@pytest.mark.parametrize(
    "source,dtype",
    [
        ("seed", None),
        ("weights", None),
        ("seed", torch.bfloat16),
        ("weights", torch.bfloat16),
        ("bf16 weights", torch.bfloat16),
    ],
)
def test_masters(fake_world, layout, source, dtype):
    model, mesh = _model(layout, source, dtype)
    st = shard_state(model)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    params = dict(model.named_parameters())
    masters = opt.masters()
    assert list(masters) == list(params)
    zero = layout in ("zero1", "zero2")
    for name, m in masters.items():
        p, opt_pl = params[name], placements(st.plans[name].optimizer, mesh)
        assert isinstance(m, DTensor) and tuple(m.placements) == opt_pl and m.shape == p.shape, name
        if not zero:  # stored as the optimizer wants it (float32 also under bf16 training, NOTE [mixed precision])
            assert m is p, f"{name}: stored as the optimizer wants it, yet copied"
            continue
        assert m.dtype == torch.float32, (name, m.dtype)
        assert m is not p, name
        block = _block(p, mesh, opt_pl)
        if dtype is None:  # a view of the parameter's own storage, this rank's block
            assert m._local_tensor.untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr(), name
            assert m._local_tensor.data_ptr() == block.data_ptr() and torch.equal(m._local_tensor, block), name
        else:  # float32: rounded to bf16 it is the stored block
            assert m._local_tensor.untyped_storage().data_ptr() != p._local_tensor.untyped_storage().data_ptr()
            assert torch.equal(m._local_tensor.to(torch.bfloat16), block), name
            if source == "bf16 weights":  # nothing finer to start from: the stored block itself
                assert torch.equal(m._local_tensor, block.float()), name
            elif p.ndim > 1:  # the unrounded random weights (main_grad.take_init_master), finer than bf16
                assert not torch.equal(m._local_tensor, block.float()), name


@pytest.mark.parametrize("frozen", ["tok_emb", "layers.0.attn.wq", "norm.weight"])
def test_frozen_parameters_are_left_out(fake_world, frozen):
    model, _mesh = _model("zero1")
    params = dict(model.named_parameters())
    params[frozen].requires_grad_(False)
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    want = [n for n in params if n != frozen]
    assert list(opt.masters()) == want
    assert len(opt.inner.param_groups[0]["params"]) == len(want)


@pytest.mark.parametrize(
    "cls,local", [(torch.optim.AdamW, True), (torch.optim.SGD, True), (torch.optim.Adafactor, False)]
)
def test_elementwise_optimizers_step_on_local_tensors_others_whole(fake_world, cls, local):
    model, _mesh = _model("fsdp")
    opt = ShardedOptimizer(model, cls, lr=0.1)
    for p in model.parameters():
        p.grad = DTensor.from_local(
            torch.ones_like(p._local_tensor),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
    opt.step()
    assert len(opt._locals) == (len(opt.masters()) if local else 0)
    assert all(isinstance(k, DTensor) for k in opt.inner.state)
    # a whole-tensor optimizer's masters are replicated (NOTE [whole-tensor step]); fsdp's stored shards are not
    assert all((tuple(m.placements) == (Replicate(),)) != local for m in opt.masters().values())


@pytest.mark.parametrize("mb", [0.25, 1, 64.0])
def test_bucket_mb_takes_any_positive_size(fake_world, mb):
    model, _mesh = _model("zero1")
    ShardedOptimizer(model, torch.optim.SGD, lr=0.1, bucket_mb=mb)


@pytest.mark.parametrize("mb", [0, -1.0, float("nan")])
def test_bucket_mb_not_positive_is_refused(fake_world, mb):
    model, _mesh = _model("zero1")
    with pytest.raises(
        ValueError,
        match=rf"^ShardedOptimizer\(bucket_mb={mb}\): must be a positive number of MiB, "
        r"or None for one chunk per block$",
    ):
        ShardedOptimizer(model, torch.optim.SGD, lr=0.1, bucket_mb=mb)


def test_bucket_mb_is_mebibytes(fake_world):
    """``bucket_mb`` counts MiB (2**20 bytes) of whole parameters: a cap of 1.5 blocks merges
    the blocks in pairs (a chunk closes once it holds at least the cap; the embedding and
    the head, each larger than the cap, come first and close their own)."""
    init_fake(2)
    mesh = meshlm.make_mesh({"dp": 2}, fake=True)
    model = meshlm.shard(Llama(llama_config("llama_tiny", layers=4, vocab=4096), device="meta"), "zero1", mesh)
    block = sum(q.numel() * q.element_size() for q in model.layers[0].parameters())
    opt = ShardedOptimizer(model, torch.optim.SGD, lr=0.1, bucket_mb=1.5 * block / 2**20)
    key = {fqn: k for (fqn, _p, _m), k in zip(opt._pairs, opt._keys)}
    layer = [{k for f, k in key.items() if f.startswith(f"layers.{i}.")} for i in range(4)]
    assert all(len(ks) == 1 for ks in layer), layer
    assert layer[0] == layer[1] != layer[2] == layer[3], layer


@pytest.mark.parametrize("layout", ["zero1", "zero2", "fsdp"])
def test_whole_tensor_masters_under_bf16_are_replicated_float32(fake_world, layout):
    """A whole-tensor optimizer (NOTE [whole-tensor step]) under bf16 training: its masters
    are replicated float32, from the unrounded initial weights where the layout keeps them
    (ZeRO-1/2: main_grad.take_init_master, placed as the layout's optimizer section says)."""
    model, mesh = _model(layout, "seed", torch.bfloat16)
    st = shard_state(model)
    opt = ShardedOptimizer(model, torch.optim.Adafactor, lr=0.1)
    params = dict(model.named_parameters())
    for name, m in opt.masters().items():
        p = params[name]
        assert tuple(m.placements) == (Replicate(),) and m.dtype == torch.float32 and m.shape == p.shape, name
        # this rank's block under the layout's optimizer placements: the only part of a
        # gathered master that a fake process group fills in
        pl = placements(st.plans[name].optimizer, mesh)
        mine, stored = _block(m, mesh, pl), _block(p, mesh, pl)
        assert torch.equal(mine.to(p.dtype), stored), name
        if layout != "fsdp" and p.ndim > 1:  # bf16 storage: the master is finer than it
            assert not torch.equal(mine, stored.float()), name


@pytest.mark.parametrize("layout", ["ddp", "zero1", "fsdp"])
def test_master_dtype_of_bf16_storage_is_a_float32_copy(fake_world, layout):
    """``ShardedOptimizer(master_dtype=torch.float32)`` over bf16 storage (``param_dtype``
    alone, no main gradients): float32 masters in the optimizer placements, this rank's
    block of the stored weights."""
    model, mesh = _model(layout, shard_kw={"param_dtype": torch.bfloat16})
    st = shard_state(model)
    opt = ShardedOptimizer(model, torch.optim.SGD, torch.float32, lr=0.1)
    params = dict(model.named_parameters())
    for name, m in opt.masters().items():
        p, opt_pl = params[name], placements(st.plans[name].optimizer, mesh)
        assert tuple(m.placements) == opt_pl and m.dtype == torch.float32 and m.shape == p.shape, name
        assert torch.equal(m._local_tensor, _block(p, mesh, opt_pl).float()), name
