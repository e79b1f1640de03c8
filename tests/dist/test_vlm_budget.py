"""Collective budget of the VLM under a scoped layout: the encoder's collectives follow its
scope's formula and the decoder's its own (one training step, 4 gloo processes, fsdp=2 x
tp=2, counted with meshlm.runtime.comm.CommCounter per kind, mesh axis and phase).

The layout keeps the language model and the projector tensor parallel over tp and data
parallel over fsdp (parameters replicated over fsdp), and scopes the encoder to ``fsdp``
(ZeRO-3 of the parameters with an ``embed`` dim, plain data parallelism for the others) or
to ``ddp``.  The budget is derived here from the model's parameter list and the textbook
formulas (docs/layouts.md, shipped layouts), not from the lowering:

encoder under fsdp (Lv blocks; Ψe its parameters with an embed dim, Ψr the others):
    all-gather fsdp forward    one per block + one per parameter outside blocks, 4·Ψe
    all-gather fsdp backward   one per block (only blocks re-gather), 4·Ψe of the blocks
    reduce-scatter fsdp bwd    as the forward all-gather
    all-reduce fsdp backward   one per block holding Ψr (its bucket), 4·Ψr
encoder under ddp: its gradients all-reduced over fsdp, one per block + one per parameter
    outside blocks, 4·Ψv; nothing else.
language + projector (Megatron TP over tp, DDP over fsdp; L blocks):
    all-reduce tp forward      2L + 1 (two per block, the vocab-parallel embedding) + 1 (the
                               projector's row-parallel output), (2L+1)·bsh + b·P·h·4
    all-reduce tp backward     2L + 1 (the head's input gradient instead of the embedding's)
                               + 1 (the projector's input gradient, flowing to the encoder),
                               (2L+1)·bsh + b·P·e·4
    all-reduce fsdp backward   the gradients: one per block + one per parameter outside
                               blocks, 4 x each parameter's tp shard
    all-reduce fsdp forward    the loss, 4 bytes
(b rows per rank, s tokens per row, P image tokens, h the decoder's width, e the encoder's.)
"""

from __future__ import annotations

import pytest

from harness import dist_pool_fixture

pool4 = dist_pool_fixture(4, timeout_s=60)
LAYOUT = """\
params: {heads: tp, kv_heads: tp, mlp: tp, vocab: tp}
compute: {batch: [dp, fsdp], heads: tp, kv_heads: tp, mlp: tp, vocab: tp}
scopes:
  vision: VISION
"""
TP_AXES = ("heads", "kv_heads", "mlp", "vocab")  # the logical axes the layout maps to tp


def _count(layout: str) -> dict:
    import torch
    from test_vlm import INPUT_AXES, Batches

    import meshlm
    from meshlm.runtime.comm import CommCounter
    from meshlm.models import VLM, vlm_config
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = meshlm.make_mesh("fsdp=2,tp=2")
    model = meshlm.shard(VLM(vlm_config("vlm_tiny"), device="meta"), layout, mesh, seed=0)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=0.1)
    (t, y, im), _ = Batches()(0, 0)
    axes = (("batch", "seq"), ("batch", "seq"), INPUT_AXES[2])
    args = [meshlm.shard_batch(v, layout, mesh, a) for v, a in zip((t, y, im), axes)]
    cc = CommCounter(mesh)
    with cc:
        with cc.phase("forward"):
            loss = model(*args)
        with cc.phase("backward"):
            loss.backward()
        with cc.phase("optimizer"):
            opt.step()
    from meshlm.plan.scopes import state_by_scope

    counted = {k: (int(v["count"]), int(v["bytes"])) for k, v in cc.summary(by_phase=True).items()}
    return counted, state_by_scope(model, opt, meshlm.load_layout(layout))


def budget(vision: str) -> dict:
    from meshlm.core.annotate import is_block, param_axes_of
    from meshlm.models import VLM, vlm_config

    c = vlm_config("vlm_tiny")
    model = VLM(c, device="meta")
    tp, fsdp = 2, 2
    blocks = {n for n, m in model.named_modules() if is_block(m)}
    vis = {"blocks": set(), "e_blk": 0, "e_out": 0, "n_e_out": 0, "r": 0, "r_blocks": set(), "all": 0, "n_out": 0}
    lang = {"blocks": set(), "bytes": 0, "n_out": 0}
    for mname, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            axes = param_axes_of(mod)[pname]
            blk = next((b for b in blocks if mname == b or mname.startswith(b + ".")), None)
            n = p.numel()
            if mname.startswith("vision"):
                vis["all"] += n
                vis["n_out"] += blk is None
                if blk is not None:
                    vis["blocks"].add(blk)
                if "embed" in axes:  # ZeRO-3 under fsdp
                    vis["e_blk" if blk else "e_out"] += n
                    vis["n_e_out"] += blk is None
                else:  # replicated: all-reduced in its block's bucket
                    vis["r"] += n
                    vis["r_blocks"].add(blk)
            else:
                shard = n // tp if any(a in TP_AXES for a in axes) else n
                lang["bytes"] += 4 * shard
                if blk is None:
                    lang["n_out"] += 1
                else:
                    lang["blocks"].add(blk)
    L = len(lang["blocks"])
    b, s, P, h, e = 8 // fsdp, 24, c.patches, c.language.embed, c.vision_embed
    bsh = b * s * h * 4
    out = {
        ("all_reduce", ("fsdp",), "forward"): (1, 4),
        ("all_reduce", ("tp",), "forward"): (2 * L + 2, (2 * L + 1) * bsh + b * P * h * 4),
        ("all_reduce", ("tp",), "backward"): (2 * L + 2, (2 * L + 1) * bsh + b * P * e * 4),
    }
    grads_count, grads_bytes = L + lang["n_out"], lang["bytes"]
    if vision == "fsdp":
        lv = len(vis["blocks"])
        gathered = 4 * (vis["e_blk"] + vis["e_out"])
        out[("all_gather", ("fsdp",), "forward")] = (lv + vis["n_e_out"], gathered)
        out[("all_gather", ("fsdp",), "backward")] = (lv, 4 * vis["e_blk"])
        out[("reduce_scatter", ("fsdp",), "backward")] = (lv + vis["n_e_out"], gathered)
        assert None not in vis["r_blocks"], "a replicated encoder parameter outside blocks: add it to the count"
        grads_count += len(vis["r_blocks"])
        grads_bytes += 4 * vis["r"]
    else:  # ddp: every encoder gradient all-reduced
        grads_count += len(vis["blocks"]) + vis["n_out"]
        grads_bytes += 4 * vis["all"]
    out[("all_reduce", ("fsdp",), "backward")] = (grads_count, grads_bytes)
    return out


@pytest.mark.parametrize("vision", ["fsdp", "ddp"])
def test_vlm_scoped_budget(pool4, tmp_path, vision):
    path = tmp_path / f"vision_{vision}.yaml"
    path.write_text(LAYOUT.replace("VISION", vision))
    measured = [m for m, _state in pool4.run(_count, str(path))]
    assert all(m == measured[0] for m in measured[1:]), "ranks disagree on their collectives"
    want = budget(vision)
    diff = {
        k: (measured[0].get(k), want.get(k)) for k in set(measured[0]) | set(want) if measured[0].get(k) != want.get(k)
    }
    assert not diff, f"vision: {vision}: (kind, axes, phase): (measured, budget) (count, bytes): {diff}"


@pytest.mark.parametrize("vision", ["fsdp", "ddp"])
def test_planned_scopes_equal_the_measured_run(pool4, tmp_path, vision):
    """meshlm plan's per-scope figures (NOTE [planned scopes] in meshlm/plan/scopes.py) against
    a real step on 4 gloo processes: each scope's model state exactly; its parameter
    traffic, summed over scopes, equal to the counted gathers and gradient reductions over
    fsdp (which only parameters make here), and the encoder's gathers and reduce-scatters
    its own (no other scope has any)."""
    from meshlm.models import VLM, vlm_config
    from meshlm.plan.measured import plan_model

    path = tmp_path / f"vision_{vision}.yaml"
    path.write_text(LAYOUT.replace("VISION", vision))
    runs = pool4.run(_count, str(path))
    plan = plan_model(
        lambda device: VLM(vlm_config("vlm_tiny"), device=device),
        str(path),
        {"fsdp": 2, "tp": 2},
        global_batch=8,
        seq=24,
    )
    counted, state = runs[0]
    assert set(plan.scopes) == {"vision", "top level"}
    for scope, got in state.items():
        assert plan.scopes[scope]["memory"] == got, scope
    assert state["vision"]["optimizer"] > 0 and state["top level"]["optimizer"] > 0
    planned: dict = {}
    for sc in plan.scopes.values():
        for k, b in sc["comm"].items():
            planned[k] = planned.get(k, 0) + b
    params_traffic = {
        f"{kind} {axes[0]} {phase}": b
        for (kind, axes, phase), (_n, b) in counted.items()
        if axes == ("fsdp",)
        and kind in ("all_gather", "reduce_scatter")
        or (kind, axes, phase) == ("all_reduce", ("fsdp",), "backward")
    }
    assert planned == params_traffic
    vision_only = {k: b for k, b in params_traffic.items() if not k.startswith("all_reduce")}
    assert {k: b for k, b in plan.scopes["vision"]["comm"].items() if not k.startswith("all_reduce")} == vision_only
