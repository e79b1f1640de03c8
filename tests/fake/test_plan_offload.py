"""`meshlm plan` under offload (NOTE [planned offload] in meshlm/plan/offload.py): what
``offload.optimizer``, ``offload.params`` and ``offload.activations`` move off the device, per tier, and the
traffic of a step; held to the runtime's own count of what moves
(``OptimizerOffload.nbytes`` of a real ``ShardedOptimizer``) and to the plan without
offload; ``layout=auto`` planning with ``offload.optimizer=host`` only when nothing fits on
the device alone; the JSON, the text, ``meshlm train``'s planned figures and docs/plan.md."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
B, S = 4, 8


@pytest.fixture
def no_pg():
    """Leave no process group behind (the measured planner starts its own)."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _real_optimizer_bytes(layout: str, sizes: dict, master_dtype=None, dtype="bfloat16") -> tuple[int, int, tuple]:
    """(what ``offload.optimizer`` moves, the number of parameters) of llama_tiny sharded as
    ``meshlm train`` shards it under ``dtype`` compute, on rank 0 of a fake process group of
    ``sizes`` (real tensors; the collectives do nothing)."""
    import meshlm
    from harness.simworld import fake_mesh
    from meshlm.app.config import TrainConfig
    from meshlm.layout.precision import shard_dtypes
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.offload.host_step import planned
    from meshlm.runtime.offload.store import Swapper
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    mesh = fake_mesh(sizes)
    if master_dtype is None:
        kw = shard_dtypes(TrainConfig(param_dtype=dtype), meshlm.load_layout(layout), sizes)
    else:  # the library API: bf16 storage over masters of master_dtype
        kw = {"param_dtype": torch.bfloat16}
    model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), layout, mesh, seed=0, **kw)
    # host on a CPU tensor moves nothing (NOTE [swapped storage]): only the count is wanted
    mdt = getattr(torch, master_dtype) if master_dtype else None
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, master_dtype=mdt, offload=Swapper("host"))
    return opt.offload.nbytes(), len(list(model.parameters())), planned(opt)


def _plan(layout, sizes, master_dtype=None, **kw):
    from meshlm.plan import plan

    dtypes = (
        dict(param_dtype="auto", compute_dtype="bfloat16")
        if master_dtype is None
        else dict(param_dtype="bfloat16", master_dtype=master_dtype)
    )
    return plan("llama_tiny", layout, sizes, global_batch=B, seq=S, **dtypes, **kw)


@pytest.mark.parametrize(
    "layout,sizes,master",
    [
        ("ddp", {"dp": 1}, None),
        ("fsdp", {"dp": 1}, None),
        ("zero1", {"dp": 1}, None),
        ("zero1", {"dp": 2}, None),  # bf16 storage over float32 master shards of their own
        ("fsdp", {"fsdp": 2}, None),
        ("ddp", {"dp": 2}, "float32"),  # whole float32 masters of bf16 parameters
    ],
)
def test_optimizer_on_disk_is_what_the_runtime_moves(layout, sizes, master, no_pg):
    """The disk holds exactly ``OptimizerOffload.nbytes``; that is the plan's optimizer state
    less AdamW's 4-byte step counters (which stay), and the device total drops by it.  On
    host, which steps there (NOTE [host step]), the host holds that and the host step's
    masters and gradient buffers, and a step moves the gradients down and the parameters up,
    as ``host_step.planned`` counts from the runtime's optimizer (whose moves
    tests/dist/test_offload_host.py checks)."""
    moved, n_params, (extra, up, down) = _real_optimizer_bytes(layout, sizes, master)
    base = _plan(layout, sizes, master)
    off = _plan(layout, sizes, master, offload={"optimizer": "disk"})
    k = off.offload["kinds"]["optimizer"]
    assert k["tier"] == "disk" and k["bytes"] == moved == off.tiers["disk"], (k, moved)
    assert base.memory["optimizer"] - 4 * n_params == moved
    assert off.memory["optimizer"] == 4 * n_params
    assert base.memory["total"] - off.memory["total"] == moved == base.tiers["device"] - off.tiers["device"]
    assert off.tiers == {"device": off.memory["total"], "host": 0, "disk": moved}
    assert k["in_bytes"] == k["out_bytes"] == moved  # read in and written out once a step
    host = _plan(layout, sizes, master, offload={"optimizer": "host"})
    assert host.tiers == {"device": off.memory["total"], "host": moved + extra, "disk": 0}
    h = host.offload["kinds"]["optimizer"]
    assert (h["in_bytes"], h["out_bytes"]) == (up, down) and 0 < up <= down
    assert base.offload["kinds"] == {} and base.tiers == {"device": base.memory["total"], "host": 0, "disk": 0}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_activations_on_the_tier_and_one_unit_on_the_device(ac):
    """offload.activations: what the plan counts as saved for backward (held activations and
    at-use copies) moves, once out and once in per micro-batch; the device keeps no more
    than one block's (or the head's), and the rest of the memory is unchanged."""
    from meshlm.plan import plan

    kw = dict(global_batch=8, seq=64, grad_accum=2, activation_checkpointing=ac)
    base = plan("llama_tiny", "fsdp", {"fsdp": 2}, **kw)
    off = plan("llama_tiny", "fsdp", {"fsdp": 2}, offload={"activations": "host"}, **kw)
    a = base.formulas["activations"]
    saved = base.memory["activations"] + base.memory["gathered"]
    k = off.offload["kinds"]["activations"]
    assert k["tier"] == "host" and k["bytes"] == saved == off.tiers["host"]
    assert k["in_bytes"] == k["out_bytes"] == 2 * saved  # two micro-batches
    one_unit = max(a["per_layer"], a["outside_blocks"]) + base.memory["gathered"]  # at most
    assert 0 < off.memory["activations"] == k["kept_on_device"] <= one_unit
    assert off.memory["activations"] <= saved and off.memory["gathered"] == 0
    if ac == "none":  # two blocks and a head: one of them is less than all three
        assert off.memory["activations"] < base.memory["activations"]
    for kind in ("params", "grads", "optimizer", "recompute"):
        assert off.memory[kind] == base.memory[kind], kind
    assert base.memory["total"] - off.memory["total"] == saved - off.memory["activations"]


def test_measured_plan_runs_the_offloaded_step(no_pg):
    """The measured planner runs the chunked optimizer step and the saved-tensor hooks on
    fake tensors: the same bytes move as by formula and by the runtime's count, the step
    reads and writes them once, and the device's optimizer, held activations and peak drop."""
    import torch.distributed as dist

    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan_model

    moved, n_params, _host = _real_optimizer_bytes("fsdp", {"fsdp": 2})
    dist.destroy_process_group()
    kw = dict(global_batch=8, seq=128, grad_accum=2, shard_kw={"compute_dtype": torch.bfloat16})

    def build(device):
        return Llama(llama_config("llama_tiny"), device=device)

    base = plan_model(build, "fsdp", {"fsdp": 2}, **kw)
    off = plan_model(build, "fsdp", {"fsdp": 2}, offload={"optimizer": "disk", "activations": "host"}, **kw)
    o, a = off.offload["kinds"]["optimizer"], off.offload["kinds"]["activations"]
    assert o["bytes"] == o["in_bytes"] == o["out_bytes"] == moved == off.tiers["disk"]
    assert (
        o["bytes"] == _plan("fsdp", {"fsdp": 2}, offload={"optimizer": "disk"}).offload["kinds"]["optimizer"]["bytes"]
    )
    assert base.memory["optimizer"] - off.memory["optimizer"] == moved and off.memory["optimizer"] == 4 * n_params
    # written once per micro-batch; a tensor saved by several ops (q, k, v) is read back by each
    assert a["in_bytes"] >= a["out_bytes"] == 2 * a["bytes"] > 0 and off.tiers["host"] == a["bytes"]
    assert off.memory["activations"] < base.memory["activations"]
    assert 0 < base.memory["peak"] - off.memory["peak"] and off.tiers["device"] == off.memory["total"]
    from meshlm.plan import format_plan
    from meshlm.plan.offload import size

    text = format_plan(off)
    assert f"offload: activations=host: {size(a['bytes'])} on host" in text and "measured on fake tensors" in text


@pytest.mark.parametrize(
    "layout,sizes,dtype",
    [  # fsdp's sharded gradients: under fsdp_tp; ZeRO-1's own master shards: under bf16
        ("ddp", {"dp": 2}, None),
        ("fsdp_tp", {"fsdp": 2, "tp": 2}, None),
        # bf16 storage: float32 main gradients (NOTE [main grads]), on the tier too
        ("zero1", {"dp": 2}, "bfloat16"),
        ("zero2", {"dp": 2}, "bfloat16"),
    ],
)
def test_grads_on_the_tier_formula_equals_the_measured_step(layout, sizes, dtype, no_pg):
    """offload.grads: the formula's bytes on the tier and traffic (each micro-batch writes the
    gradients, the later ones read them to add to them, the step reads them; ZeRO-1's
    shards are written and read once) equal what the runtime's GradOffload moves in the
    measured step on fake tensors; the device keeps two of the largest gradient, and the
    measured peak drops."""
    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan, plan_model

    kw = dict(global_batch=8, seq=32, grad_accum=2)
    fkw, mkw = {}, {}
    if dtype is not None:  # as meshlm train sets them (precision.shard_dtypes)
        from meshlm.app.config import TrainConfig
        from meshlm.layout.precision import shard_dtypes
        from meshlm.layout.rules import load_layout

        fkw = dict(param_dtype="auto", compute_dtype=dtype)
        mkw = dict(shard_kw=shard_dtypes(TrainConfig(param_dtype=dtype), load_layout(layout), sizes))
    formula = plan("llama_tiny", layout, sizes, offload={"grads": "disk"}, **kw, **fkw)
    base_f = plan("llama_tiny", layout, sizes, **kw, **fkw)
    k = formula.offload["kinds"]["grads"]
    assert k["tier"] == "disk" and k["bytes"] == formula.tiers["disk"] > 0
    assert formula.memory["grads"] == k["kept_on_device"] < base_f.memory["grads"]
    assert base_f.memory["total"] - formula.memory["total"] == base_f.memory["grads"] - k["kept_on_device"]

    def build(device):
        return Llama(llama_config("llama_tiny"), device=device)

    base = plan_model(build, layout, sizes, **kw, **mkw)
    meas = plan_model(build, layout, sizes, offload={"grads": "disk"}, **kw, **mkw)
    m = meas.offload["kinds"]["grads"]
    assert (m["bytes"], m["in_bytes"], m["out_bytes"]) == (k["bytes"], k["in_bytes"], k["out_bytes"])
    if dtype is not None:
        assert formula.param_dtype == meas.param_dtype == "bfloat16"
    if layout != "zero1":  # no master gradients of their own: written and read once per micro-batch
        assert k["in_bytes"] == k["out_bytes"] == 2 * k["bytes"] == 2 * base_f.memory["grads"]
    assert meas.memory["grads"] == 0 < base.memory["grads"]  # after backward and after the step: none held
    assert meas.memory["peak"] < base.memory["peak"]


def test_step_time_adds_the_traffic():
    """The cost model adds the offloaded bytes over the profile's host bandwidth, not
    overlapped; a plan without offload is timed as before."""
    from meshlm.plan import HARDWARE, model_config, step_time

    hw = HARDWARE["h100_nvlink_ib"]
    base = _plan("fsdp", {"fsdp": 2})
    off = _plan("fsdp", {"fsdp": 2}, offload={"optimizer": "host"})
    k = off.offload["kinds"]["optimizer"]
    cfg = model_config("llama_tiny")[1]
    t0, t1 = step_time(base, cfg, hw), step_time(off, cfg, hw)
    assert "offload_s" not in t0 and t1["offload_s"] == (k["in_bytes"] + k["out_bytes"]) / hw.host_bw
    assert t1["step_s"] == pytest.approx(t0["step_s"] + t1["offload_s"])


def _auto_kwargs(cap_bytes: float) -> dict:
    return dict(model="llama_tiny", devices=2, max_memory=f"{cap_bytes}B", global_batch=B, seq=S, hardware="cpu", top=3)


def _totals(offload=None) -> list[int]:
    from meshlm.plan import candidates

    return [r.plan.memory["total"] for r in candidates("llama_tiny", 2, global_batch=B, seq=S, offload=offload)]


def test_layout_auto_offloads_the_optimizer_only_when_nothing_fits():
    from meshlm.app.plan import choose_layout
    from meshlm.plan import NothingFits

    on_device, on_host = min(_totals()), min(_totals({"optimizer": "host"}))
    assert on_host < on_device
    out = io.StringIO()
    choice = choose_layout(**_auto_kwargs((on_host + on_device) / 2), out=out)
    head = out.getvalue().splitlines()[0]
    assert "nothing fits on the device alone; with offload.optimizer=host" in head, head
    assert choice.offload == {"optimizer": "host"} and choice[0] in out.getvalue().splitlines()[2]
    out = io.StringIO()
    choice = choose_layout(**_auto_kwargs(on_device * 1.001), out=out)  # one fits on the device: no offload
    assert choice.offload is None and "offload" not in out.getvalue()
    assert choice[0] in out.getvalue().splitlines()[2]
    with pytest.raises(NothingFits) as e:  # not even with it: the optimizer dominated, so it says how small
        choose_layout(**_auto_kwargs(on_host * 0.99), out=io.StringIO())
    assert "dominated by optimizer" in str(e.value)
    assert f"(offload.optimizer=host) the smallest is {on_host / 2**30:.2f} GiB" in str(e.value), str(e.value)
    # the run's own offload.optimizer is kept: nothing else is tried
    with pytest.raises(NothingFits):
        choose_layout(**_auto_kwargs((on_host + on_device) / 2), out=io.StringIO(), offload={"optimizer": "device"})
    out = io.StringIO()
    choice = choose_layout(**_auto_kwargs((on_host + on_device) / 2), out=out, offload={"optimizer": "host"})
    assert choice.offload is None and "alone" not in out.getvalue()  # the run offloads: its candidates fit


def test_candidates_without_offload_rank_first():
    from meshlm.plan import Candidate, Plan
    from meshlm.plan.search import rank_key

    def cand(step_s, kinds):
        p = Plan("m", "l", {"dp": 2}, 2, 2, 2, "float32", "float32", "none", {"total": 1}, {})
        p.offload = {"kinds": kinds}
        return Candidate(p, {"step_s": step_s, "comm_s": 0.0})

    fast_offloaded = cand(1.0, {"optimizer": {"tier": "host"}})
    slow_on_device = cand(2.0, {})
    assert sorted([fast_offloaded, slow_on_device], key=rank_key) == [slow_on_device, fast_offloaded]


def test_json_of_a_plan_made_by_hand():
    """A Plan made without the new fields (an older caller) still has them in its JSON."""
    from meshlm.layout.offload import KINDS
    from meshlm.plan import Plan

    p = Plan("m", "l", {"dp": 2}, 2, 2, 2, "float32", "float32", "none", {"params": 3, "total": 7}, {})
    d = json.loads(json.dumps(p.to_json()))
    assert d["tiers"] == {"device": 7, "host": 0, "disk": 0}
    assert d["offload"]["kinds"] == {} and all(d["offload"][k] == "device" for k in KINDS)


def test_plan_cli_offload_text_json_and_train_command(capsys, tmp_path):
    """`meshlm plan ... offload.optimizer=disk`: the offload line and the tiers in the text,
    the same in the JSON; layout=auto that needs offload prints a train command with it."""
    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main
    from meshlm.plan.offload import size

    over = ["model=llama_tiny", "mesh=fsdp2", "layout=fsdp", "plan.method=formula", "offload.optimizer=disk"]
    plain = [a for a in over if not a.startswith("offload.")]
    assert plan_main(load_config(over + ["plan.format=json"]), over) == 0
    d = json.loads(capsys.readouterr().out)
    assert plan_main(load_config(plain + ["plan.format=json"]), plain) == 0
    d0 = json.loads(capsys.readouterr().out)
    k = d["offload"]["kinds"]["optimizer"]
    assert d["offload"]["optimizer"] == "disk" and d["offload"]["activations"] == "device"
    assert d["tiers"] == {"device": d["memory"]["total"], "host": 0, "disk": k["bytes"]}
    assert d0["memory"]["optimizer"] - d["memory"]["optimizer"] == k["bytes"] == k["in_bytes"] == k["out_bytes"]
    assert d0["offload"]["kinds"] == {} and d0["tiers"] == {"device": d0["memory"]["total"], "host": 0, "disk": 0}
    assert "offload.optimizer=disk" in d["train_command"]
    assert plan_main(load_config(over), over) == 0
    text = capsys.readouterr().out
    want = f"offload: optimizer=disk: {size(k['bytes'])} on disk, {size(k['bytes'])} in + {size(k['bytes'])} out"
    assert want in text and f"device {size(d['tiers']['device'])}" in text
    assert plan_main(load_config(plain), plain) == 0
    assert "offload" not in capsys.readouterr().out
    measured = [a for a in over if a != "plan.method=formula"] + ["plan.format=json"]
    assert plan_main(load_config(measured), measured) == 0  # the measured planner, from the CLI
    dm = json.loads(capsys.readouterr().out)
    assert "peak" in dm["memory"] and dm["tiers"]["disk"] == dm["offload"]["kinds"]["optimizer"]["bytes"] == k["bytes"]
    from meshlm.app.plan import _measured

    # layout=auto's measured planner plans each candidate with the run's offload settings
    assert _measured(load_config(over))("fsdp", {"fsdp": 2}).tiers["disk"] == k["bytes"]

    cap = (min(_totals()) + min(_totals({"optimizer": "host"}))) / 2
    argv = [
        "layout=auto",
        "model=llama_tiny",
        "mesh=dp2",
        f"train.batch_size={B}",
        f"train.seq_len={S}",
        "plan.profile=cpu",
        "plan.method=formula",
        f"plan.max_memory_per_device={cap}B",
        "plan.headroom=0",
        f"plan.png={tmp_path / 'p.png'}",
    ]
    assert plan_main(load_config(argv), argv) == 0
    out = capsys.readouterr().out
    assert "with offload.optimizer=host" in out.splitlines()[0] and "offload: optimizer=host" in out
    assert "the device is host memory" in out  # the cpu profile says what host means there
    cmd = out.strip().splitlines()[-1]
    assert " offload.optimizer=host " in cmd and cmd.startswith("run it: meshlm train model=llama_tiny"), cmd


def test_planned_memory_of_an_offloaded_run(no_pg):
    """`meshlm train`'s planned figures are the device's: the optimizer state on disk is not
    on it (what the runtime moves leaves the optimizer and the total); on a CPU run
    offload=host moves nothing, so it stays."""
    from meshlm.app.config import load_config
    from meshlm.app.run_report import planned_memory

    base = ["model=llama_tiny", "mesh=fsdp2", "layout=fsdp", "train.device=cpu", "train.param_dtype=float32"]
    p0 = planned_memory(load_config(base), "fsdp", {"fsdp": 2})
    disk = planned_memory(load_config(base + ["offload.optimizer=disk"]), "fsdp", {"fsdp": 2})
    host = planned_memory(load_config(base + ["offload.optimizer=host"]), "fsdp", {"fsdp": 2})
    moved, n_params, _host = _real_optimizer_bytes("fsdp", {"fsdp": 2}, dtype="float32")
    assert p0["optimizer"] - disk["optimizer"] == moved == p0["total"] - disk["total"]
    assert disk["optimizer"] == 4 * n_params and disk["params"] == p0["params"] and host == p0
    deep = base + ["model.layers=6"]  # more blocks than the two the device keeps
    p6 = planned_memory(load_config(deep), "fsdp", {"fsdp": 2})
    params = planned_memory(load_config(deep + ["offload.params=disk"]), "fsdp", {"fsdp": 2})
    blocks, one, _outside = _real_block_bytes({"fsdp": 2}, layers=6)
    assert p6["params"] - params["params"] == blocks - 2 * one == p6["total"] - params["total"] > 0


def _real_block_bytes(sizes: dict, layers: int) -> tuple[int, int, int]:
    """(stored bytes of every block's parameters, of one block's, of the rest) of an fp32
    llama_tiny of ``layers`` blocks under fsdp on rank 0 of a fake process group, counted
    from the sharded module's own local tensors."""
    import dataclasses

    import meshlm
    from harness.simworld import fake_mesh
    from meshlm import _torch_compat as compat
    from meshlm.core.annotate import outer_blocks
    from meshlm.models import Llama, llama_config

    cfg = dataclasses.replace(llama_config("llama_tiny"), layers=layers)
    model = meshlm.shard(Llama(cfg, device="meta"), "fsdp", fake_mesh(sizes), seed=0)

    def nbytes(ps):
        return sum(compat.local_tensor(p).numel() * 4 for p in ps)

    blocks = [nbytes(b.parameters()) for b in outer_blocks(model)]
    return sum(blocks), max(blocks), nbytes(model.parameters()) - sum(blocks)


def test_params_on_disk_are_the_blocks_parameters(no_pg):
    """offload.params: the tier holds every block's stored parameters, counted from the
    sharded model; the device keeps the rest and two blocks'; each block's come in for its
    forward and backward in every micro-batch and for the step, and are written once; the
    measured planner, which runs the runtime's ParamOffload on fake tensors, moves the same
    bytes; a layout whose optimizer keeps copies of them is refused."""
    import dataclasses

    import torch.distributed as dist

    from meshlm.core.errors import ConfigError
    from meshlm.models import Llama, llama_config
    from meshlm.plan import plan, plan_model

    blocks, one, outside = _real_block_bytes({"fsdp": 2}, layers=3)  # one more than the device keeps
    dist.destroy_process_group()
    cfg = dataclasses.replace(llama_config("llama_tiny"), layers=3)
    kw = dict(global_batch=8, seq=16, grad_accum=2)
    base = plan(("deep", cfg), "fsdp", {"fsdp": 2}, **kw)
    off = plan(("deep", cfg), "fsdp", {"fsdp": 2}, offload={"params": "disk"}, **kw)
    k = off.offload["kinds"]["params"]
    assert k["bytes"] == blocks == off.tiers["disk"] and base.memory["params"] == blocks + outside
    assert off.memory["params"] == outside + 2 * one and k["kept_on_device"] == 2 * one
    assert k["in_bytes"] == blocks * (2 * 2 + 1) and k["out_bytes"] == blocks
    measured = plan_model(lambda d: Llama(cfg, device=d), "fsdp", {"fsdp": 2}, offload={"params": "disk"}, **kw)
    m = measured.offload["kinds"]["params"]
    assert (m["bytes"], m["in_bytes"], m["out_bytes"]) == (k["bytes"], k["in_bytes"], k["out_bytes"])
    with pytest.raises(ConfigError, match=r"offload\.params=host: layout zero2 keeps optimizer copies"):
        plan(("deep", cfg), "zero2", {"dp": 2}, offload={"params": "host"}, **kw)


def test_offload_refusals_name_the_key():
    from meshlm.app.plan import choose_layout
    from meshlm.core.errors import ConfigError
    from meshlm.plan import plan_model

    with pytest.raises(ConfigError, match=r"offload\.grads='nvme' is not a tier"):
        choose_layout(**_auto_kwargs(2**40), out=io.StringIO(), offload={"grads": "nvme"})
    with pytest.raises(
        ConfigError, match=r"offload optimizer=disk: meshlm plan does not plan offload under a pipeline"
    ):
        plan_model(lambda d: None, "pp", {"pp": 2}, global_batch=B, seq=S, offload={"optimizer": "disk"})


def test_docs_offload_example_is_what_the_command_prints(capsys, monkeypatch, tmp_path):
    """docs/plan.md's Offload section quotes a command and its offload lines as it prints them."""
    from meshlm.app.cli import main

    monkeypatch.chdir(tmp_path)  # its plot goes under outputs/ here

    page = (DOCS / "plan.md").read_text()
    block = page.split("## Offload", 1)[1].split("```\n", 1)[1].split("\n```", 1)[0]
    head, *quoted = block.splitlines()
    main(["plan", *shlex.split(head.removeprefix("$ meshlm plan "))])
    got = capsys.readouterr().out.splitlines()
    assert quoted and all(line in got for line in quoted), (quoted, [g for g in got if re.match(r"offload|on each", g)])


def test_meshlm_train_layout_auto_runs_the_winner_with_its_offload(capsys):
    """``meshlm train layout=auto`` (cli.resolve_auto) trains the winner with the offload it
    needs to fit, not without."""
    from meshlm.app.cli import resolve_auto
    from meshlm.app.config import load_config

    on_device, on_host = min(_totals()), min(_totals({"optimizer": "host"}))
    args = [
        "model=llama_tiny",
        "layout=auto",
        "mesh=dp2",
        "plan.devices=2",
        f"train.batch_size={B}",
        f"train.seq_len={S}",
        "plan.profile=cpu",
        "plan.headroom=0",
        "plan.method=formula",
    ]
    cfg = resolve_auto(load_config(args + [f"plan.max_memory_per_device={int((on_host + on_device) / 2)}B"]))
    assert cfg.layout.name != "auto" and cfg.offload.optimizer == "host"
    cfg = resolve_auto(load_config(args + [f"plan.max_memory_per_device={int(on_device * 1.001)}B"]))
    assert cfg.layout.name != "auto" and cfg.offload.optimizer is None
