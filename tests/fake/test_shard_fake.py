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


def test_a_new_fake_group_gets_fresh_meshes_from_dtensor_ops(fake_world):
    """A fake group torn down and another started (the planner does this per candidate):
    an op that DTensor computed on an equal mesh of the first group gives this group's mesh,
    whose process groups resolve, not the first one's (DTensor's caches compare meshes by
    value; ``init_fake`` clears them)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    def cast_on_a_new_mesh():
        mesh = meshlm.make_mesh({"dp": 2, "fsdp": 2, "tp": 2}, fake=True)
        t = distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Shard(0), Replicate()])
        out = t.to(torch.bfloat16)
        return mesh, out

    cast_on_a_new_mesh()
    dist.destroy_process_group()
    meshlm.make_mesh({"dp": 4, "fsdp": 2}, fake=True)  # the new group numbers its groups differently
    mesh, out = cast_on_a_new_mesh()
    assert out.device_mesh is mesh
    assert [out.device_mesh.get_group(i).group_name for i in range(3)] == [
        mesh.get_group(i).group_name for i in range(3)
    ]
