"""Big meshes with the fake process group: placements and local shapes, never numerics."""

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import meshlm
from meshlm.models import Llama, llama_config
from meshlm.runtime.lowering import plan_params


@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_shard_on_256_fake_ranks(fake_world):
    cfg = llama_config("llama_tiny", vocab=1024, embed=256, heads=16, kv_heads=8, mlp=512)
    mesh = meshlm.make_mesh({"dp": 2, "fsdp": 16, "tp": 8}, fake=True)
    assert dist.get_world_size() == 256 and mesh.mesh_dim_names == ("dp", "fsdp", "tp")
    model = meshlm.shard(Llama(cfg, device="meta"), "fsdp_tp", mesh)
    plans = plan_params(Llama(cfg, device="meta"), meshlm.load_layout("fsdp_tp"), mesh)
    sizes = {"dp": 2, "fsdp": 16, "tp": 8}
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), n
        assert tuple(p.to_local().shape) == plans[n].local_shape(plans[n].storage, sizes), n
    wq = model.layers[0].attn._parameters["wq"]
    # heads over tp on dim 0, embed over fsdp on dim 2, replicated over dp
    assert wq.placements == (Replicate(), Shard(2), Shard(0))
    assert tuple(wq.to_local().shape) == (16 // 8, 16, 256 // 16)
    emb = model._parameters["tok_emb"]
    assert emb.placements == (Replicate(), Shard(1), Shard(0)) and tuple(emb.to_local().shape) == (1024 // 8, 256 // 16)


def test_fake_mesh_of_16384_ranks_places_llama3_405b_without_memory(fake_world):
    mesh = meshlm.make_mesh({"dp": 16, "fsdp": 128, "tp": 8}, fake=True)
    assert mesh.size() == 16384
    plans = plan_params(Llama(llama_config("llama3_405b"), device="meta"), meshlm.load_layout("fsdp_tp"), mesh)
    wq = plans["layers.0.attn.wq"]
    assert wq.local_shape(wq.storage, {"dp": 16, "fsdp": 128, "tp": 8}) == (128 // 8, 128, 16384 // 128)
    assert len(plans) == 126 * 9 + 3
