"""``meshlm.unshard`` in one process (NOTE [unshard] in meshlm/runtime/unshard.py): on a mesh
of one device (a fake process group of one, where a gather is the identity) a sharded,
checkpointed, compiled model comes back as the plain module it was built as, its weights
those it was initialised with, bit for bit; unsharding twice changes nothing; what it
refuses, it refuses before any collective.  After training on 4 processes, under every
layout: tests/dist/test_unshard.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshlm
from harness.simworld import fake_mesh
from meshlm.models import Llama, llama_config
from meshlm.runtime import hooks

CFG = llama_config("llama_tiny", layers=2)


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _plain_like(model, ref) -> None:
    from torch.distributed.tensor import DTensor

    for (name, m), (_, r) in zip(model.named_modules(), ref.named_modules()):
        assert type(m) is type(r), name
        assert set(vars(m)) == set(vars(r)), (name, set(vars(m)) ^ set(vars(r)))
        assert not m._forward_hooks and not m._forward_pre_hooks, name
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor) and p.grad is None, n
    assert list(model.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("ckpt,comms", [("full", None), ("none", "graph"), ("none", "eager")])
def test_unshard_gives_back_the_plain_model_with_its_weights(ckpt, comms):
    """Checkpointed blocks (a wrapped forward), blocks compiled in place (their own call) or
    their bodies only (an attribute), run forward and backward, then unsharded."""
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.compile import compile_blocks

    ref = Llama(CFG, seed=0)
    model = meshlm.shard(Llama(CFG, device="meta"), "ddp", fake_mesh({"dp": 1}), seed=0)
    apply_activation_checkpointing(model, ckpt)
    if comms is not None:
        compile_blocks(model, "aot_eager", comms=comms)
        where = {"graph": "_compiled_call_impl", "eager": "_meshlm_body"}[comms]
        assert all(where in vars(b) for b in model.layers)
    tokens = torch.randint(0, CFG.vocab, (2, 8))
    model(tokens, tokens).backward()
    assert meshlm.unshard(model) is model
    _plain_like(model, ref)
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=0, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, tokens), ref(tokens, tokens), rtol=0, atol=0)
    params = [id(p) for p in model.parameters()]
    assert meshlm.unshard(model) is model  # a plain model stays as it is: the same Parameters
    assert [id(p) for p in model.parameters()] == params


def test_unshard_refuses_a_submodule():
    model = meshlm.shard(Llama(CFG, device="meta"), "fsdp", fake_mesh({"fsdp": 2}), seed=0)
    with pytest.raises(meshlm.MeshlmError, match="submodule of a sharded model"):
        meshlm.unshard(model.layers[0])
    assert type(model.layers[0]).__name__ == "ShardedTransformerBlock"  # nothing was undone


def test_unshard_refuses_parameters_of_another_stage_without_their_pipeline():
    keep = {n for n, _ in Llama(CFG, device="meta").named_parameters() if not n.startswith("layers.1.")}
    model = meshlm.shard(Llama(CFG, device="meta"), "fsdp", fake_mesh({"fsdp": 2}), seed=0, keep=keep)
    with pytest.raises(meshlm.MeshlmError, match=r"`layers\.1\..*held by another pipeline stage"):
        meshlm.unshard(model)


class _OnePlace:
    """A placement stub for Stages: one device runs every block."""

    devices = 1

    def runs(self, d):
        return [0, 1]

    def owner(self, i):
        return 0


def test_unshard_refuses_staged_decoding():
    from meshlm.infer.stages import Stages

    model = Llama(CFG, seed=0)
    Stages(model, _OnePlace(), 0)
    assert type(model.layers[0]).__name__ == "StagedTransformerBlock"
    with pytest.raises(meshlm.MeshlmError, match="staged decoding"):
        meshlm.unshard(model)
    hooks.detach_all(model)
    assert type(model.layers[0]).__name__ == "TransformerBlock"
