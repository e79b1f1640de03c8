"""meshlm.app.config: conf/ composes into a validated RunConfig; bad values name key and choices."""

import pytest

from meshlm.app.config import MeshConfig, RunConfig, from_dict, load_config
from meshlm.app.train import check_world, lr_at
from meshlm.core.errors import ConfigError, MeshError
from meshlm.layout.rules import shipped_layouts


def test_defaults_are_the_quickstart():
    cfg = load_config([])
    assert isinstance(cfg, RunConfig)
    assert (cfg.model.name, cfg.layout.name, cfg.mesh.as_dict()) == ("llama_small", "fsdp_tp", {"fsdp": 2, "tp": 2})
    assert cfg.model.llama().embed == 256
    assert cfg.checkpoint.dir is None and cfg.plan.top == 5


def test_overrides_and_groups():
    cfg = load_config(
        ["layout=ddp", "mesh=dp4", "model=llama_tiny", "train.steps=7", "data.path=/x.txt", "model.layers=3"]
    )
    assert (cfg.layout.name, cfg.mesh.as_dict(), cfg.train.steps, cfg.data.path) == ("ddp", {"dp": 4}, 7, "/x.txt")
    assert cfg.model.llama().layers == 3


def test_every_shipped_layout_has_a_conf_entry():
    for name in shipped_layouts():
        assert load_config([f"layout={name}"]).layout.name == name
    assert load_config(["layout=auto"]).layout.name == "auto"


@pytest.mark.parametrize(
    "override,words",
    [
        ("train.compile=jit", ["train.compile", "none", "aot_eager", "inductor"]),
        ("train.compile_comms=host", ["train.compile_comms", "graph", "eager"]),
        ("train.activation_checkpointing=some", ["train.activation_checkpointing", "full", "selective"]),
        ("train.param_dtype=fp8", ["train.param_dtype", "bfloat16"]),
        ("train.compute_dtype=bfloat16", ["train.compute_dtype", "not a config key", "train.param_dtype=bfloat16"]),
        ("train.reduce_dtype=null", ["train.reduce_dtype", "null", "train.reduce_dtype=float32"]),
        ("checkpoint.resume=latest", ["checkpoint.resume='latest'", "checkpoint.resume=auto", "./latest"]),
        ("checkpoint.resume=none", ["checkpoint.resume='none'", "checkpoint.resume=null"]),
        ("checkpoint.resume=auto", ["checkpoint.resume=auto", "checkpoint.dir"]),
        ("train.steps=0", ["train.steps", ">= 1"]),
        ("train.steps=abc", ["train.steps", "integer"]),
        ("model.layers=0", ["model.layers=0", "positive"]),
        ("model.layer=3", ["model.layer", "takes no argument", "layers"]),
        ("model._target_=nosuch.Model", ["model._target_=nosuch.Model", "PYTHONPATH"]),
        ("data.format=csv", ["data.format", "text", "tokens"]),
        ("train.grad_accum=3", ["train.batch_size", "train.grad_accum"]),
        ("train.stpes=5", ["train.stpes is not a config key (did you mean 'train.steps'?)", "keys of train: steps"]),
        ("trian.steps=5", ["trian.steps is not a config key (did you mean 'train.steps'?)", "model, layout"]),
        ("steps=5", ["steps is not a config key (did you mean 'train.steps'?)"]),
        ("modle=llama_tiny", ["modle is not a config key (did you mean 'model'?)"]),
        ("train.format=text", ["train.format", "did you mean 'data.format' or 'plan.format'"]),
        ("layout=fsdp_tpp", ["layout=fsdp_tpp: no option 'fsdp_tpp'", "did you mean 'fsdp_tp'", "zero2"]),
        ("mesh=dp3", ["no option 'dp3' in the config group mesh", "dp4"]),
        ("checkpoint=x", ["checkpoint is a config section", "checkpoint.KEY=VALUE", "resume"]),
        ("mesh.tp=0", ["mesh.tp"]),
        ("pipeline.schedule=1f1", ["pipeline.schedule", "gpipe", "1f1b", "zbv"]),
        ("pipeline.stages_per_rank=0", ["pipeline.stages_per_rank=0", ">= 1"]),
        ("pipeline.split=[2,0]", ["pipeline.split", "each >= 1"]),
    ],
)
def test_bad_value_names_key_and_choices(override, words):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["layout=ddp", "mesh=dp4", "train.batch_size=6"], ["train.batch_size=6", "4 data-parallel ranks (dp of mesh dp=4 under layout ddp)", "multiple of 4", "4 or 8"]),
        (["layout=fsdp", "mesh=dp2_fsdp2", "train.batch_size=12", "train.grad_accum=2"], ["train.grad_accum=2 micro-batches x 4 data-parallel ranks (dp x fsdp", "multiple of 8", "8 or 16"]),
        (["layout=fsdp_tp", "mesh=fsdp2_tp2", "train.batch_size=1"], ["train.batch_size=1", "multiple of 2", "nearest being 2 ("]),
        (["mesh=cpu1", "train.batch_size=7", "train.grad_accum=2"], ["train.grad_accum=2 micro-batches;", "6 or 8", "change train.grad_accum)"]),
    ],
)  # fmt: skip
def test_batch_size_that_does_not_split_names_it_and_the_nearest_values(overrides, words):
    """Checked when the config is read (it failed in the workers, as a layout error that never
    named train.batch_size); a mesh with a -1 axis is checked once the world size is known."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_batch_size_of_every_shape_that_splits_passes():
    from meshlm.app.config import check_batch

    load_config(["layout=tp", "mesh=tp4", "train.batch_size=3"])  # tp does not split the batch
    load_config(["layout=auto", "train.batch_size=3"])  # the planner picks a mesh that splits it
    cfg = load_config(["layout=ddp", "mesh.dp=-1", "mesh.fsdp=1", "mesh.tp=1", "train.batch_size=6"])
    with pytest.raises(ConfigError, match=r"train.batch_size=6 .* 4 data-parallel ranks .* 4 or 8"):
        check_batch(cfg, {"dp": 4})  # meshlm.app.train.run, the world size known
    check_batch(cfg, {"dp": 3})


def test_config_typo_on_the_command_line_is_one_line_with_the_closest_key(capsys):
    """Before Hydra, which said "Key 'stpes' is not in struct" over six lines, and exited."""
    from meshlm.app.cli import main

    assert main(["train", "train.stpes=5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("meshlm train: error: train.stpes is not a config key (did you mean 'train.steps'?)"), err
    assert err.count("\n") == 1, err
    assert main(["train", "-m", "layout=ddp,zeroo2"]) == 1
    assert "(did you mean 'zero2'" in capsys.readouterr().err
    assert main(["plan", "trian.steps=5"]) == 1
    assert (
        "meshlm plan: error: trian.steps is not a config key (did you mean 'train.steps'?)" in capsys.readouterr().err
    )


def test_one_spelling_per_idea(capsys):
    """Retired keys and other words for a value fail naming the one spelling, from a
    saved config (a dict) as from the command line, and in the Checkpointer API too."""
    import torch

    from meshlm.train.checkpoint import CheckpointConfig, Checkpointer

    with pytest.raises(ConfigError, match=r"train.compute_dtype is not a config key.*train.param_dtype=bfloat16"):
        from_dict({"train": {"compute_dtype": "bfloat16"}})
    # configs saved before the key was retired hold compute_dtype: null, which says nothing
    assert from_dict({"train": {"compute_dtype": None, "param_dtype": "bfloat16"}}).train.param_dtype == "bfloat16"
    assert load_config(["checkpoint.dir=/x", "checkpoint.resume=auto"]).checkpoint.resume == "auto"
    assert load_config(["checkpoint.resume=runs/ck/latest"]).checkpoint.resume == "runs/ck/latest"
    from meshlm.app.cli import main

    assert main(["train", "train.compute_dtype=bfloat16"]) == 1  # before Hydra, which would only say "not in struct"
    assert "train.param_dtype=bfloat16" in capsys.readouterr().err
    for word, right in (("latest", "auto"), ("never", "null"), ("", "null")):
        ck = Checkpointer(CheckpointConfig(dir="/nonexistent", resume=word), model=torch.nn.Linear(1, 1))
        with pytest.raises(ConfigError, match=f"checkpoint.resume={right}"):
            ck.resume()


def test_unknown_key_and_group_option():
    with pytest.raises(
        ConfigError, match=r"unknown key train.stepz \(did you mean 'train.steps'\?\); allowed keys in train"
    ):
        from_dict({"train": {"stepz": 3}})
    with pytest.raises(ConfigError, match="layout"):
        load_config(["layout=nope"])


def test_mesh_size_mismatch_says_both_numbers():
    cfg = load_config(["mesh=fsdp2_tp2"])
    with pytest.raises(MeshError, match=r"4 devices but the job has 2 processes"):
        check_world(cfg, 2)
    check_world(load_config(["mesh.dp=-1", "mesh.fsdp=2", "mesh.tp=1"]), 8)
    assert MeshConfig(dp=-1, tp=2).size(8) == 8


def test_lr_schedule_warmup_then_cosine():
    t = load_config(["train.steps=100", "train.warmup_steps=10", "train.lr=1.0", "train.min_lr=0.1"]).train
    assert lr_at(1, t) == pytest.approx(0.1) and lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.55) and lr_at(100, t) == pytest.approx(0.1)
    lrs = [lr_at(s, t) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_bad_optimizer_bucket_and_compile_comms_name_the_argument():
    """Checked before anything is built, so a plain module is enough."""
    import torch

    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    with pytest.raises(ValueError, match=r"bucket_mb=0\): must be a positive number of MiB, or None"):
        ShardedOptimizer(torch.nn.Linear(2, 2), bucket_mb=0)
    with pytest.raises(ValueError, match=r"comms='host'\): expected one of \['graph', 'eager'\]"):
        compile_blocks(torch.nn.Linear(2, 2), "aot_eager", comms="host")
