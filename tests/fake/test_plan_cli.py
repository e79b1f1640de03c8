"""`meshlm plan` and `layout=auto` end to end in one process (no process group: the planner is
analytic), on RunConfigs composed from conf/ as the CLI does."""

from __future__ import annotations

import io
import json

import pytest


def test_plan_text_and_json(capsys):
    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main

    over = [
        "model=llama3_70b",
        "mesh.dp=4",
        "mesh.fsdp=8",
        "mesh.tp=8",
        "layout=fsdp_tp",
        "train.batch_size=256",
        "train.seq_len=8192",
        "train.param_dtype=bfloat16",
        "plan.method=formula",
    ]
    assert plan_main(load_config(over)) == 0
    text = capsys.readouterr().out
    assert "layout fsdp_tp, mesh dp=4,fsdp=8,tp=8 (256 ranks)" in text and "param re-gather in backward" in text
    assert plan_main(load_config(over + ["plan.format=json"])) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == 1 and d["mesh"] == {"dp": 4, "fsdp": 8, "tp": 8} and d["master_dtype"] == "float32"
    assert d["memory"]["total"] == sum(v for k, v in d["memory"].items() if k != "total")


def test_choose_layoutfrom_run_config(tmp_path):
    from meshlm.app.config import load_config
    from meshlm.app.plan import choose_layout

    cfg = load_config(
        [
            "layout=auto",
            "model=llama_tiny",
            "mesh=dp4",
            "train.batch_size=8",
            "train.seq_len=16",
            "plan.profile=cpu",
            f"plan.png={tmp_path / 'c.png'}",
            "plan.method=formula",
        ]
    )
    out = io.StringIO()
    layout, mesh = choose_layout(cfg, out=out)
    assert layout in out.getvalue().splitlines()[2] and (tmp_path / "c.png").exists()
    assert mesh and all(v > 1 for v in mesh.values())


def test_plan_auto_plots_under_outputs(tmp_path, monkeypatch, capsys):
    """`meshlm plan layout=auto` without plan.png writes its plot under outputs/ in the
    current directory, as `meshlm train` writes its runs, never beside the code."""
    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main

    monkeypatch.chdir(tmp_path)
    assert (
        plan_main(
            load_config(
                [
                    "layout=auto",
                    "model=llama_tiny",
                    "mesh=dp4",
                    "train.batch_size=8",
                    "train.seq_len=16",
                    "plan.profile=cpu",
                    "plan.method=formula",
                ]
            )
        )
        == 0
    )
    (png,) = [p.relative_to(tmp_path) for p in tmp_path.rglob("*.png")]
    assert png.parts[:2] == ("outputs", "plan") and png.name == "plan.png" and len(png.parts) == 5, png
    assert f"(memory breakdown of these candidates: {png})" in capsys.readouterr().out


def test_nothing_fits_names_what_to_grow(tmp_path):
    """...and draws no picture of bars over the limit: the error says so."""
    from meshlm.app.plan import choose_layout
    from meshlm.plan import NothingFits

    png = tmp_path / "plan.png"
    with pytest.raises(
        NothingFits,
        match=r"smallest any candidate reaches is .* dominated by activations.*"
        r"smaller micro-batches.*\(No memory picture written: nothing fits\.\)",
    ):
        choose_layout(
            png=str(png),
            model="llama3_70b",
            devices=8,
            max_memory="80GiB",
            global_batch=8,
            seq=32768,
            param_dtype="bfloat16",
            hardware="h100_nvlink_ib",
            out=io.StringIO(),
        )
    assert not png.exists()


def test_405b_on_16384_ranks_plans():
    from meshlm.plan import plan

    p = plan(
        "llama3_405b",
        "fsdp_tp_sp",
        {"dp": 16, "fsdp": 128, "tp": 8},
        global_batch=2048,
        seq=8192,
        activation_checkpointing="full",
        param_dtype="bfloat16",
        master_dtype="float32",
    )
    assert p.world_size == 16384 and 0 < p.memory["total"] < 80 * 2**30


def test_measured_plan_ends_with_the_train_command_of_its_winner(tmp_path, capsys):
    """`meshlm plan layout=auto` (measured: a fake step per candidate) prints the winner's
    `meshlm train` command: the given overrides, less layout/mesh/plan, plus the winner."""
    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main

    argv = [
        "layout=auto",
        "model=llama_tiny",
        "model.layers=1",  # a fake step per candidate: one block is enough for the command
        "mesh=dp2",
        "train.batch_size=4",
        "train.seq_len=8",
        "plan.profile=cpu",
        f"plan.png={tmp_path / 'p.png'}",
        "plan.top=1",
    ]
    assert plan_main(load_config(argv), argv) == 0
    out = capsys.readouterr().out
    winner = out.splitlines()[2].split()
    cmd = out.strip().splitlines()[-1]
    given = "model=llama_tiny model.layers=1 train.batch_size=4 train.seq_len=8"
    assert cmd.startswith(f"run it: meshlm train {given} "), cmd
    assert f"layout={winner[1]}" in cmd and "plan." not in cmd and "mesh=dp2" not in cmd
    sizes = dict(kv.split("=") for kv in winner[2].split(","))
    assert [f"mesh.{a}={sizes.get(a, 1)}" for a in ("dp", "fsdp", "tp")] == cmd.split(f"layout={winner[1]} ")[1].split()


def test_headroom_and_ties_toward_lower_memory():
    """plan.headroom shrinks the limit; of two equally fast candidates the one with less
    memory ranks first, whatever their communication time."""
    from meshlm.plan import Candidate, Plan
    from meshlm.plan.search import rank_key

    def cand(total, comm_s):
        p = Plan("m", "l", {"dp": 2}, 2, 2, 2, "float32", "float32", "none", {"total": total}, {})
        return Candidate(p, {"step_s": 1.0, "comm_s": comm_s})

    rows = sorted([cand(200, 0.1), cand(100, 0.5)], key=rank_key)
    assert [r.plan.memory["total"] for r in rows] == [100, 200]
    with pytest.raises(NothingFits_(), match=r"nothing fits in 0\.5 GiB"):
        from meshlm.app.plan import choose_layout

        choose_layout(
            model="llama_small",
            devices=1,
            max_memory="1GiB",
            headroom=0.5,
            global_batch=8,
            seq=4096,
            hardware="cpu",
            out=io.StringIO(),
        )


def NothingFits_():
    from meshlm.plan import NothingFits

    return NothingFits


def test_plan_a_users_model_from_its_node(capsys, monkeypatch):
    """`meshlm plan model._target_=mymodels.TinyLM model.width=32`: a model in a package of
    its own, planned by measurement, with the command that trains it; the formula, which
    knows the shipped Llama only, says so."""
    import sys
    from pathlib import Path

    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main
    from meshlm.core.errors import ConfigError

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "usermodel"))
    sys.modules.pop("mymodels", None)
    over = [
        "model._target_=mymodels.TinyLM",
        "model.width=32",
        "layout=fsdp",
        "mesh=fsdp2",
        "train.seq_len=32",
        "train.batch_size=8",
        "plan.profile=cpu",
    ]
    assert plan_main(load_config(over), over) == 0
    out = capsys.readouterr().out
    assert out.startswith("meshlm plan: TinyLM, layout fsdp, mesh fsdp=2") and "measured on fake tensors" in out
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("run it: meshlm train model._target_=mymodels.TinyLM model.width=32 train.seq_len=32")
    ), out[-300:]
    with pytest.raises(ConfigError, match="plan.method=formula plans the shipped Llama only"):
        plan_main(load_config(over + ["plan.method=formula"]), over)


def test_pipeline_plan_prints_every_pp_rank(capsys):
    """`meshlm plan` of a pipeline layout: a row per pp rank (its stages, blocks, state, what
    is in flight at its peak, what it sends), the schedule's bubble, the train command."""
    from meshlm.app.config import load_config
    from meshlm.app.plan import plan_main

    argv = [
        "model=llama_tiny",
        "model.layers=4",
        "layout=pp",
        "mesh=pp2",
        "train.grad_accum=4",
        "train.batch_size=8",
        "train.seq_len=16",
        "pipeline.schedule=1f1b",
    ]
    assert plan_main(load_config(argv), argv) == 0
    out = capsys.readouterr().out
    assert "layout pp, mesh pp=2 (2 ranks)" in out and "pipeline schedule 1f1b, bubble 0.200" in out, out[:600]
    rows = [ln.split() for ln in out.splitlines() if ln[:1] in ("0", "1") and "GiB" in ln]
    assert [r[:3] for r in rows] == [["0", "0", "2"], ["1", "1", "2"]], rows
    assert "send            pp" in out and "recv            pp" in out
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith("pipeline.schedule=1f1b layout=pp mesh.dp=1 mesh.fsdp=1 mesh.tp=1 mesh.pp=2")
    ), out.strip().splitlines()[-1]


def test_layout_auto_considers_pipelines():
    """layout=auto plans the pipeline layouts on every mesh with a pp axis of size > 1 (and
    never on one without, where each is another layout's candidate already)."""
    from meshlm.core.errors import ConfigError
    from meshlm.plan import search

    asked = []

    def planner(layout, mesh):
        asked.append((layout, dict(mesh)))
        raise ConfigError("not planned here")  # the candidate is dropped, as one that does not apply

    search.candidates("llama_tiny", 4, global_batch=8, seq=16, grad_accum=4, planner=planner)
    piped = [(lay, m) for lay, m in asked if lay in ("pp", "fsdp_pp", "fsdp_tp_pp")]
    assert ("pp", {"dp": 1, "fsdp": 1, "tp": 1, "pp": 4}) in piped and (
        "pp",
        {"dp": 2, "fsdp": 1, "tp": 1, "pp": 2},
    ) in piped
    assert ("fsdp_pp", {"dp": 1, "fsdp": 2, "tp": 1, "pp": 2}) in piped
    assert all(m["pp"] > 1 for _lay, m in piped) and all("pp" not in m for lay, m in asked if (lay, m) not in piped)
    assert search.candidates("llama_tiny", 4, global_batch=8, seq=16, grad_accum=4) is not None  # formula: no pp
