"""Expert parallel and context parallel inside pipeline stages, against one device
(``check_training``: each micro-batch loss, the gradient each optimizer steps with and
every parameter after 2 SGD steps of 2 micro-batches; the stages' parameters checked on
the ranks that hold them).

Expert parallel: a mixture of experts under ``fsdp_ep_pp`` on ep=2 x pp=2, one block per
stage; its load-balancing and z-loss coefficients are on (moe_tiny's 0.01 and 0.001), so
stage 0's block's auxiliary loss reaches the loss only through the side outputs stage 0
sends (NOTE [side outputs] in meshlm/runtime/pipeline/stage.py): dropped, the loss is off
by 260x its tolerance; sent without its gradient, tok_emb's gradient by 439x.

Context parallel: Llama with 4 blocks under ``fsdp_cp_pp`` on cp=2 x pp=2, each
micro-batch split over cp in causally balanced chunks; what crosses between stages is each
cp rank's slice of the sequence (checked against the one-device hidden state).  With the
chunks unbalanced by mistake (``CpMesh.balance`` False while the data is balanced), the
loss is off by 2.9x its tolerance and the slices differ.
"""

from __future__ import annotations

import pytest

from meshlm.runtime.pipeline.schedule import zero_bubble_supported
from harness import dist_pool_fixture
from harness.parity import LlamaBuild, MoEBuild, TokenBatches, assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=60)

BATCHES = TokenBatches(batch=8, seq=16)
LLAMA4 = LlamaBuild("llama_tiny", (("layers", 4),))
V2 = "zbv" if zero_bubble_supported() else "interleaved_1f1b"  # a two-stages-per-rank schedule this torch runs


def _moe(pool, build, schedule):
    return pool.run(
        check_training,
        "fsdp_ep_pp",
        "ep=2,pp=2",
        build=build,
        batches=BATCHES,
        optims=("sgd",),
        steps=2,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ep_inside_stages(pool4, schedule):
    assert_parity(_moe(pool4, MoEBuild(), schedule))


def test_ep_inside_stages_zero_bubble_v(pool4):
    """Four blocks, two stages per rank in a V (stages 1 and 2 on one rank: the side
    outputs handed over without a send), torch's zero-bubble split backward."""
    res = pool4.run(
        check_training,
        "fsdp_ep_pp",
        "ep=2,pp=2",
        build=MoEBuild(overrides=(("layers", 4),)),
        batches=BATCHES,
        optims=("sgd",),
        steps=2,
        schedule=V2,
        stages_per_rank=2,
    )
    assert_parity(res)


def test_ep_inside_stages_without_aux_losses(pool4):
    """Both coefficients 0: the blocks' auxiliary losses are zeros with no gradient, and the
    loss does not use them; they still cross stages."""
    assert_parity(_moe(pool4, MoEBuild(overrides=(("balance_loss", 0.0), ("z_loss", 0.0))), "1f1b"))


def test_ep_inside_stages_shared_experts(pool4):
    """The fine-grained shape with a gated shared expert (Qwen2-MoE's), capacity routing."""
    assert_parity(_moe(pool4, MoEBuild("moe_shared_tiny", (("capacity_factor", 1.0),)), "1f1b"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cp_inside_stages(pool4, schedule):
    res = pool4.run(
        check_training,
        "fsdp_cp_pp",
        "cp=2,pp=2",
        build=LLAMA4,
        batches=TokenBatches(seq=32),
        optims=("sgd",),
        steps=2,
        schedule=schedule,
    )
    assert_parity(res)


def _boundary_slices() -> tuple:
    """(pp rank, cp rank, what stage 1 received per micro-batch, the one-device hidden state
    entering stage 1's first block per micro-batch) for fsdp_cp_pp on cp=2 x pp=2."""
    import torch

    import meshlm
    from meshlm.runtime.pipeline import build_pipeline, pipeline_mesh

    rows, seq, m = 2, 32, 2
    full, sub = pipeline_mesh("cp=2,pp=2")
    lay = meshlm.load_layout("fsdp_cp_pp")
    toks = torch.randint(0, 256, (rows * m, seq + 1), generator=torch.Generator().manual_seed(0))
    micro = [(toks[j * rows : (j + 1) * rows, :-1], toks[j * rows : (j + 1) * rows, 1:]) for j in range(m)]
    pipe = build_pipeline(
        lambda d: LLAMA4(d, 0), lay, full, sub, example=(micro[0], {}), microbatches=m, schedule="1f1b"
    )
    got = []
    for sm in pipe.stage_modules:
        if sm.stage == 1:
            sm.register_forward_pre_hook(lambda _m, args: got.append(args[0].detach().clone()))
    pipe.step([(tuple(meshlm.shard_batch(t, lay, sub) for t in mb), {}) for mb in micro])
    ref, want = LLAMA4("cpu", 0), []
    ref.get_submodule(pipe.cut.stages[1][0]).register_forward_pre_hook(lambda _m, a: want.append(a[0].detach()))
    for x, y in micro:
        ref(x, y)
    return pipe.pp_rank, sub.get_local_rank("cp"), got, want


def test_cp_stages_send_balanced_sequence_slices(pool4):
    """What crosses from stage 0 to stage 1 is each cp rank's slice of the sequence in
    causally balanced chunks (rank r: chunks r and 3-r of 4, NOTE [balanced chunks] in
    meshlm/_torch_compat/dtensor_cp.py), the one-device hidden state's values: half the
    sequence per rank, never the whole."""
    import torch

    for pp_rank, r, got, want in pool4.run(_boundary_slices):
        if pp_rank == 0:
            assert got == []
            continue
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            c = w.shape[1] // 4
            torch.testing.assert_close(g, torch.cat([w[:, r * c : (r + 1) * c], w[:, (3 - r) * c : (4 - r) * c]], 1))
