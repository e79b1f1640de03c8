"""Typed run configuration: one dataclass per config section, built and checked in one place.

``conf/`` (Hydra) composes the sections; :func:`from_dict` turns the resolved plain dict
into a :class:`RunConfig` and checks every value, so no DictConfig travels past
``meshlm/app/cli.py`` and a bad value fails before any process starts, naming the key and
the allowed values.  :func:`load_config` composes ``conf/`` with Hydra's compose API for
tests and other commands (``meshlm plan``); Hydra is imported there lazily.

NOTE [config defaults]
    Every key's default is written once, in its dataclass (here, and the library's
    ``DataConfig``, ``CheckpointConfig`` and the model node's ``ModelConfig``).  Before Hydra
    composes, :func:`register_defaults` stores ``RunConfig().to_dict()`` in Hydra's
    ConfigStore as ``meshlm_defaults``, the first entry of ``conf/config.yaml``'s defaults
    list, so every key exists (``train.steps=5`` needs no ``+``) and ``--cfg job`` prints it.
    The YAML holds only choices: the quickstart's groups (``model``, ``mesh``, ``layout``) and
    what each group option sets that differs from the defaults (``mesh/dp2.yaml`` is
    ``dp: 2``).  The node is plain data, not a structured config, so the values are checked
    here (:func:`from_dict`), with meshlm's messages.  tests/unit/test_config_defaults.py
    fails on a YAML value that restates a default and on a composed default that differs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from meshlm.app.optimizer import OptimConfig, check_optim
from meshlm.app.tracking import check_loggers
from meshlm.core.axes import MESH_AXES
from meshlm.core.errors import ConfigError
from meshlm.data.config import FORMATS, DataConfig, check_images
from meshlm.models.node import ModelConfig, model_overrides
from meshlm.runtime import COMPILE_COMMS  # train.compile_comms
from meshlm.train.checkpoint.config import CheckpointConfig, check_checkpoint_dir, check_resume  # noqa: F401 (API)
from meshlm.train.schedule import SCHEDULES

DTYPES = ("float32", "bfloat16", "float16")
COMPILE_BACKENDS = ("none", "aot_eager", "inductor")
CHECKPOINTING = ("none", "full", "selective")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZER_IMPLS = ("auto", "for_loop", "foreach", "fused")


@dataclass
class LayoutConfig:
    """``layout``: a layout name (``layouts/<name>.yaml``), a path to a YAML file, or
    ``auto`` (``meshlm.app.plan.choose_layout`` picks layout and mesh)."""

    name: str = "fsdp_tp"
    #: a layout that degenerates on the mesh (a kind of parallelism it names has no mesh axis
    #: of size > 1 left) or leaves a mesh axis of size > 1 unused is an error, not a warning
    #: (NOTE [effective sharding] in meshlm/layout/effective.py)
    strict: bool = False


@dataclass
class MeshConfig:
    """``mesh``: the size of each mesh axis (1 = unused; at most one -1 = the rest of the world)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1

    def as_dict(self) -> dict[str, int]:
        """Axes of size != 1, in canonical order (``{"dp": 1}`` for a one-device mesh)."""
        d = {a: getattr(self, a) for a in MESH_AXES if getattr(self, a, 1) != 1}
        return d or {"dp": 1}

    def size(self, world_size: Optional[int] = None) -> int:
        """Number of processes the mesh needs (with a -1 axis, ``world_size``)."""
        d = self.as_dict()
        if -1 in d.values():
            if world_size is None:
                raise ConfigError(f"mesh {self}: an axis is -1 (the rest of the world) but the world size is unknown")
            return world_size
        return math.prod(d.values())

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.as_dict().items())


@dataclass
class TrainConfig:
    """``train``: the optimisation loop (the defaults: about 1-3 minutes on 2 CPU cores)."""

    steps: int = 100
    seed: int = 0
    batch_size: int = 8  #: global sequences per optimizer step (all ranks, all micro-batches)
    seq_len: int = 128
    grad_accum: int = 1  #: micro-batches per step; each is batch_size // grad_accum sequences
    lr: float = 3e-3  #: the schedule's peak learning rate (the optimizer is the optim section)
    min_lr: float = 3e-4  #: the cosine, linear and wsd schedules end here
    warmup_steps: int = 10  #: linear warmup from 0 to lr over these steps, before any schedule
    schedule: str = "cosine"  #: cosine | linear | constant | wsd (warmup-stable-decay); NOTE [lr schedules]
    decay_frac: float = 0.2  #: wsd: the fraction of train.steps spent decaying to min_lr, at the end
    grad_clip: float = 1.0  #: max global gradient norm; 0 disables clipping
    #: the optimizer's implementation: auto (torch's default; AdamW/Adam fused when the optimizer
    #: state is offloaded and the step runs on the CPU) | for_loop | foreach | fused
    optimizer_impl: str = "auto"
    #: dtype parameters are used in (compute); storage, gradients and optimizer state stay
    #: float32 (NOTE [mixed precision] in meshlm/layout/precision.py); float16 adds loss scaling
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"  #: dtype gradients are reduced in
    compile: str = "none"  #: torch.compile per block: none | aot_eager | inductor
    compile_comms: str = "graph"  #: graph | eager: data-parallel collectives in the block graphs or around them
    activation_checkpointing: str = "none"  #: none | full | selective (per block)
    overlap: Optional[bool] = None  #: gradient reduction in flight during backward; None = on for CUDA only
    device: str = "auto"  #: auto (cuda if available) | cpu | cuda
    log_every: int = 1
    val_every: int = 25  #: validation every N steps and at the end; 0 = only at the end
    val_batches: int = 4
    skip_nonfinite: bool = False  #: skip a step whose loss is NaN/Inf instead of stopping
    pg_timeout_s: float = 300.0  #: process-group timeout: a stuck collective fails after this
    progress: bool = True  #: tqdm progress bar on rank 0
    profile: bool = False  #: write a torch profiler trace of steps [profile_start, +profile_steps)
    profile_start: int = 3
    profile_steps: int = 2
    memory_snapshot: bool = False  #: CUDA only: dump an allocator snapshot (pytorch.org/memory_viz)
    count_comm: bool = True  #: count collective bytes of one step (comm_bytes in metrics)
    # Fault injection, for tests of the fault handling only.
    inject_nan_step: int = -1  #: make the loss NaN at this step
    inject_crash_step: int = -1  #: raise on rank inject_crash_rank at this step
    inject_crash_rank: int = 0


@dataclass
class PlanConfig:
    """``plan`` (meshlm.plan): ``meshlm plan`` and ``layout=auto``."""

    devices: Optional[int] = None  #: number of devices for layout=auto; None = the mesh size
    max_memory_per_device: Optional[Any] = None  #: "80GiB", "141GB" or a number of GiB; None = the profile's
    profile: str = "auto"  #: hardware profile (meshlm.plan.HARDWARE); auto = h100_nvlink_ib with CUDA, else cpu
    overlap: bool = True  #: cost model: communication overlaps compute (max) or not (sum)
    format: str = "text"  #: text | json
    #: memory plot of the candidates; None: meshlm plan writes outputs/plan/<date>/<time>/plan.png, meshlm train none
    png: Optional[str] = None
    top: int = 5  #: how many candidate layouts to show
    headroom: float = 0.1  #: fraction of each device's memory layout=auto keeps free (allocator, runtime)
    #: measure (one fake training step of any model) | formula (analytic: the shipped Llama only, in milliseconds)
    method: str = "measure"


@dataclass
class PipelineConfig:
    """``pipeline``: how a layout with ``layers: pp`` runs (meshlm.runtime.pipeline); the
    micro-batches are ``train.grad_accum``."""

    schedule: str = "1f1b"  #: gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv (NOTE [schedules])
    stages_per_rank: int = 1  #: stages (runs of blocks) per pp rank; 2+ for interleaved_1f1b, 2 for zbv
    split: Optional[list] = None  #: blocks per stage, e.g. [3, 5]; None = balanced by parameter count
    #: ZeRO-3 inside a stage: gather parameters at every use (less memory), not once per step
    regather: bool = False


@dataclass
class OffloadConfig:
    """``offload``: the memory tier (device | host | disk) of each kind of training state,
    over the layout's own ``offload`` section (null: the layout's, else device); NOTE
    [offload tiers] in meshlm/runtime/offload/__init__.py."""

    optimizer: Optional[str] = None  #: optimizer state and master weights; the step runs chunk by chunk
    grads: Optional[str] = None  #: gradients (device only)
    params: Optional[str] = None  #: each block's parameters between uses (prefetched ahead of use)
    activations: Optional[str] = None  #: tensors autograd saves for backward
    dir: Optional[str] = None  #: the disk tier's directory; null = <run dir>/offload


@dataclass
class LoggerConfig:
    """``logger``: experiment trackers fed from rank 0 (NOTE [experiment tracking] in
    meshlm/app/tracking.py); the group ``logger=tensorboard|wandb|mlflow`` (a list for
    several: ``logger=[tensorboard,wandb]``) turns them on."""

    tensorboard: bool = False  #: torch's SummaryWriter (extra: tensorboard)
    wandb: bool = False  #: Weights & Biases (extra: wandb)
    mlflow: bool = False  #: MLflow (extra: mlflow)
    project: str = "meshlm"  #: the W&B project and the MLflow experiment
    dir: Optional[str] = None  #: where the trackers write; null: checkpoint.dir if set, else the run directory
    group: Optional[str] = None  #: the group of a sweep's runs; null: the sweep directory under -m, else none
    wandb_mode: Optional[str] = None  #: online | offline | disabled; null: W&B's own (WANDB_MODE, else online)
    mlflow_uri: Optional[str] = None  #: the MLflow tracking URI; null: the local store <dir>/mlruns


@dataclass
class RunConfig:
    """The whole run; each component receives only its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def to_dict(self) -> dict[str, Any]:
        """The plain dict :func:`from_dict` takes back (the model node in its YAML form)."""
        return {**dataclasses.asdict(self), "model": self.model.to_dict(), "optim": self.optim.to_dict()}


_SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]
OPEN_NODES = ("model", "optim")  #: sections whose keys are a target's arguments (NOTE [model node], [optim node])


def _coerce(key: str, value: Any, typ: str, default: Any = dataclasses.MISSING) -> Any:
    """Check ``value`` against a dataclass field annotation (as a string, PEP 563)."""
    typ = typ.replace(" ", "")
    optional = typ.startswith("Optional[") or typ.endswith("|None")
    base = typ[len("Optional[") : -1] if typ.startswith("Optional[") else typ.removesuffix("|None")
    if value is None:
        if optional:
            return None
        dflt = "" if default is dataclasses.MISSING else f"; the default is {key}={default}"
        raise ConfigError(f"{key} must not be null (expected {base}{dflt})")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    return value


# One key per idea: keys that said what another key says.  A null value (what configs
# saved by earlier versions hold) is dropped; any other value is an error naming the key.
RETIRED_KEYS = {
    "train.compute_dtype": "train.param_dtype is the compute dtype (parameters are stored in float32 and used in "
    "train.param_dtype): set train.param_dtype={value} and drop train.compute_dtype",
    "train.weight_decay": "the optimizer's arguments are the optim section's: set optim.weight_decay={value}",
    "train.beta1": "the optimizer's arguments are the optim section's: set optim.betas=[{value},BETA2]",
    "train.beta2": "the optimizer's arguments are the optim section's: set optim.betas=[BETA1,{value}]",
}


def check_overrides(overrides: "list[str]") -> None:
    """Refuse, before Hydra composes anything, a command-line override of a retired key (with
    the message that names its replacement) or of a key or group option that does not exist
    (with the closest ones): Hydra itself would only say that the key is not in struct."""
    searchpath = any(o.lstrip("+").startswith("hydra.searchpath") for o in overrides)
    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        if key in RETIRED_KEYS:
            raise ConfigError(f"{key} is not a config key: " + RETIRED_KEYS[key].format(value=value or "..."))
        # flags (-m, --cfg job), additions and deletions (+key=, ~key), Hydra's own keys and
        # packages (hydra.run.dir=, hydra/launcher=, group@pkg=): Hydra's to judge
        if o.startswith(("-", "+", "~")) or not eq or "/" in key or "@" in key or key.split(".")[0] == "hydra":
            continue
        _check_key(key, value, groups=not searchpath)


def _fields_of(section: str) -> list[str]:
    return [f.name for f in fields(type(_SECTIONS[section]()))]


def _near_keys(key: str) -> list[str]:
    """The config keys closest to ``key``: in its own section first, then anywhere (a key
    under another section, a section misspelt), then keys whose last name is ``key``'s."""
    import difflib

    section, _, rest = key.partition(".")
    name = rest.split(".")[0]
    keys = [f"{s}.{f}" for s in _SECTIONS if s not in OPEN_NODES for f in _fields_of(s)]
    if section in _SECTIONS and section not in OPEN_NODES and name:
        near = difflib.get_close_matches(name, _fields_of(section), n=3, cutoff=0.6)
        if near:
            return [f"{section}.{n}" for n in near]
    same = [k for k in keys if k.rsplit(".", 1)[1] == (name or section)]
    return same or difflib.get_close_matches(key, keys + list(_SECTIONS), n=3, cutoff=0.6)


def _check_key(key: str, value: str, groups: bool = True) -> None:
    """One ``key=value`` override: ``key`` names a config key or a config group, and a group's
    ``value`` one of its options (a comma list in a sweep)."""
    from meshlm.core.axes import did_you_mean

    section, dot, rest = key.partition(".")
    if section not in _SECTIONS:
        raise ConfigError(
            f"{key} is not a config key{did_you_mean(_near_keys(key))}; the config sections are: "
            f"{', '.join(_SECTIONS)} (e.g. train.steps=5, or a group: model=llama_tiny)"
        )
    if section == "model" or (
        section in OPEN_NODES and dot
    ):  # an open node: its keys are the target's (check_args, check_optim)
        return
    if dot:
        name = rest.split(".")[0]
        if name not in _fields_of(section):
            raise ConfigError(
                f"{section}.{name} is not a config key{did_you_mean(_near_keys(key))}; the keys of {section}: "
                f"{', '.join(_fields_of(section))}"
            )
        return
    try:
        options = sorted(p.stem for p in (conf_dir() / section).glob("*.yaml"))
    except ConfigError:
        return
    if not options:
        raise ConfigError(
            f"{key}={value}: {key} is a config section, not a group with options; set its keys instead "
            f"({key}.KEY=VALUE), one of: {', '.join(_fields_of(section))}"
        )
    if not groups or "(" in value or "$" in value:  # another search path; sweep functions, interpolations
        return
    from meshlm.core.axes import closest

    for v in value.strip("[]").split(","):  # a sweep's options, or a list of several (logger=[a,b])
        if v not in options:
            raise ConfigError(
                f"{key}={v}: no option {v!r} in the config group {key} (conf/{key}/){closest(v, options, n=3)}; "
                f"the options: {', '.join(options)}"
            )


def _section(name: str, cls: type, data: Any) -> Any:
    if cls in (ModelConfig, OptimConfig):  # open nodes: the target's arguments are checked against its signature
        return cls.from_dict(data)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config section {name!r} must be a mapping, got {data!r}")
    data = dict(data)
    for key in [k for k in data if f"{name}.{k}" in RETIRED_KEYS]:
        value = data.pop(key)
        if value is not None:
            raise ConfigError(f"{name}.{key} is not a config key: " + RETIRED_KEYS[f"{name}.{key}"].format(value=value))
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        from meshlm.core.axes import did_you_mean

        raise ConfigError(
            f"unknown key {name}.{unknown[0]}{did_you_mean(_near_keys(f'{name}.{unknown[0]}'))}; allowed keys in "
            f"{name}: {', '.join(known)}"
        )
    kwargs = {k: _coerce(f"{name}.{k}", v, str(known[k].type), known[k].default) for k, v in data.items()}
    return cls(**kwargs)


def _choice(key: str, value: Any, allowed: "tuple[str, ...] | list[str]") -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a plain (resolved) dict."""
    unknown = sorted(set(d) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}; allowed: {', '.join(_SECTIONS)}")
    cfg = RunConfig(**{name: _section(name, type(factory()), d.get(name)) for name, factory in _SECTIONS.items()})
    validate(cfg)
    return cfg


def _check_pipeline(p: PipelineConfig) -> None:
    from meshlm.runtime.pipeline.schedule import SCHEDULES

    _choice("pipeline.schedule", p.schedule, list(SCHEDULES))
    if p.stages_per_rank < 1:
        raise ConfigError(f"pipeline.stages_per_rank={p.stages_per_rank} must be >= 1")
    if p.split is not None and (
        not isinstance(p.split, (list, tuple)) or not all(isinstance(c, int) and c >= 1 for c in p.split)
    ):
        raise ConfigError(f"pipeline.split={p.split!r}: a list of block counts per stage, each >= 1 (or null)")


def _no_pipeline_for_images(cfg: RunConfig) -> None:
    """A pipelined run (``layers: pp`` on a mesh with pp > 1) passes tokens and targets between
    stages only: it cannot feed a model its images."""
    from meshlm.layout.rules import is_pipelined, load_layout

    if cfg.layout.name != "auto" and cfg.mesh.pp > 1 and is_pipelined(load_layout(cfg.layout.name)):
        raise ConfigError(
            f"layout {cfg.layout.name} pipelines the model (mesh.pp={cfg.mesh.pp}), which takes tokens and targets "
            "only: data.format=images cannot feed it its images; use a layout without layers: pp"
        )


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError naming the key and its allowed values for the first bad value."""
    from meshlm.layout.rules import shipped_layouts
    from meshlm.models.node import check_args

    if not cfg.model.init_from:  # with init_from, the Hugging Face config.json gives the architecture
        check_args(cfg.model)
        if cfg.model.is_llama():
            cfg.model.llama()  # field names and values
    name = cfg.layout.name
    if not (name == "auto" or name.endswith((".yaml", ".yml")) or os.sep in name):
        _choice("layout.name", name, shipped_layouts() + ["auto"])
    m = cfg.mesh
    sizes = [getattr(m, a) for a in ("dp", "fsdp", "tp", "cp", "pp", "ep")]
    for a, s in zip(("dp", "fsdp", "tp", "cp", "pp", "ep"), sizes):
        if s == 0 or s < -1:
            raise ConfigError(f"mesh.{a}={s} must be a positive integer, or -1 for 'the rest of the world'")
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh {m}: at most one axis may be -1")
    check_optim(cfg.optim)
    check_loggers(cfg.logger)
    t = cfg.train
    _choice("train.schedule", t.schedule, SCHEDULES)
    if not 0 <= t.decay_frac <= 1:
        raise ConfigError(f"train.decay_frac={t.decay_frac} must be within [0, 1] (the fraction of the steps decaying)")
    _choice("train.compile", t.compile, COMPILE_BACKENDS)
    _choice("train.compile_comms", t.compile_comms, COMPILE_COMMS)
    _choice("train.activation_checkpointing", t.activation_checkpointing, CHECKPOINTING)
    _choice("train.param_dtype", t.param_dtype, DTYPES)
    _choice("train.device", t.device, DEVICES)
    _choice("train.reduce_dtype", t.reduce_dtype, DTYPES)
    _choice("train.optimizer_impl", t.optimizer_impl, OPTIMIZER_IMPLS)
    for k in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "val_batches"):
        if getattr(t, k) < 1:
            raise ConfigError(f"train.{k}={getattr(t, k)} must be >= 1")
    for k in ("warmup_steps", "val_every"):
        if getattr(t, k) < 0:
            raise ConfigError(f"train.{k}={getattr(t, k)} must be >= 0")
    check_batch(cfg)
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"train.lr={t.lr} and train.min_lr={t.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    _choice("plan.format", cfg.plan.format, ("text", "json"))
    _check_pipeline(cfg.pipeline)
    offload_spec(cfg, None)
    _choice("data.format", cfg.data.format, FORMATS)
    if cfg.data.format == "images":
        check_images(cfg.data, t.seq_len)
        _no_pipeline_for_images(cfg)
    check_resume(cfg.checkpoint.resume)
    if cfg.checkpoint.resume == "auto" and not cfg.checkpoint.dir:
        raise ConfigError(
            "checkpoint.resume=auto resumes from the latest checkpoint in checkpoint.dir, which is not "
            "set; set checkpoint.dir=PATH"
        )
    if t.pg_timeout_s <= 0:
        raise ConfigError(f"train.pg_timeout_s={t.pg_timeout_s} must be > 0 seconds")


def batch_shards(cfg: RunConfig, sizes: "dict[str, int] | None" = None) -> tuple[int, str]:
    """How many data-parallel ranks split each micro-batch under ``cfg``'s layout on the
    mesh ``sizes`` (default ``cfg.mesh``), and which mesh axes they are (``"dp x fsdp"``):
    1 while the layout is chosen later (``auto``), a mesh axis is -1 (the world size is not
    known yet), or the layout cannot be read (where it is loaded, that says why)."""
    from meshlm.core.errors import MeshlmError
    from meshlm.layout.rules import INPUT_MESH_AXES, load_layout, resolve

    sizes = sizes if sizes is not None else {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    if cfg.layout.name == "auto" or -1 in sizes.values():
        return 1, ""
    try:
        layout = load_layout(cfg.layout.name)
        (axes,) = resolve(("batch",), layout.compute, sizes, layout=layout, allow_mesh=INPUT_MESH_AXES)
    except MeshlmError:
        return 1, ""
    return math.prod(sizes[a] for a in axes), " x ".join(axes)


def check_batch(cfg: RunConfig, sizes: "dict[str, int] | None" = None) -> None:
    """``train.batch_size`` splits into ``train.grad_accum`` micro-batches, each split evenly
    over the data-parallel ranks of the layout on the mesh (``sizes``: default ``cfg.mesh``);
    else a ConfigError naming ``train.batch_size``, the divisor and the nearest valid values."""
    t = cfg.train
    ranks, axes = batch_shards(cfg, sizes)
    n = t.grad_accum * ranks
    if t.batch_size % n == 0:
        return
    below, above = t.batch_size // n * n, (t.batch_size // n + 1) * n
    nearest = " or ".join(str(v) for v in (below, above) if v > 0)
    parts = [f"train.grad_accum={t.grad_accum} micro-batches"] if t.grad_accum > 1 else []
    if ranks > 1:
        parts.append(f"{ranks} data-parallel ranks ({axes} of mesh {cfg.mesh} under layout {cfg.layout.name})")
    change = "train.grad_accum or the mesh" if ranks > 1 else "train.grad_accum"
    raise ConfigError(
        f"train.batch_size={t.batch_size} does not split evenly into {' x '.join(parts)}; set train.batch_size "
        f"to a multiple of {n}, the nearest being {nearest} (or change {change})"
    )


def offload_spec(cfg: RunConfig, layout: Any):
    """The run's offload tiers: ``layout``'s offload section (a meshlm Layout, or None) with
    the ``offload.*`` settings over it, checked (ConfigError naming the key)."""
    from meshlm.layout.offload import resolve_offload

    given = dataclasses.asdict(cfg.offload)
    spec = resolve_offload(getattr(layout, "offload", None), given)
    return spec


def open_overrides(overrides: "list[str]") -> list[str]:
    """Command-line overrides rewritten for the open nodes ``model`` and ``optim`` (NOTE
    [model node], NOTE [optim node]): ``model.KEY=VALUE`` and ``optim.KEY=VALUE`` become
    ``++...`` (set, or add), and a ``_target_`` given without its group selects ``custom``."""
    out = model_overrides(overrides)
    rewritten = []
    for o in out:
        key, eq, _ = o.partition("=")
        rewritten.append(f"++{o}" if eq and key.startswith("optim.") else o)
    group = any(o.split("=", 1)[0].lstrip("+~") == "optim" for o in overrides)
    target = any(o.split("=", 1)[0].lstrip("+~") == "optim._target_" for o in overrides)
    if target and not group:
        rewritten.append("optim=custom")
    return rewritten


def conf_dir() -> Path:
    """The Hydra config directory: $MESHLM_CONF, else the shipped one (an installed meshlm's
    ``meshlm/conf``, else a checkout's ``conf/``; pyproject.toml maps one onto the other)."""
    env = os.environ.get("MESHLM_CONF")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[1]  # the meshlm package
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").exists():
            return cand
    raise ConfigError(f"no Hydra config directory found next to {here}; set MESHLM_CONF to the conf/ directory")


DEFAULTS = "meshlm_defaults"  #: the ConfigStore entry of the dataclasses' defaults (NOTE [config defaults])


def register_defaults() -> None:
    """Store every config key's default, from the dataclasses, in Hydra's ConfigStore as
    ``meshlm_defaults`` (NOTE [config defaults]); before Hydra composes ``conf/``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS, node=RunConfig().to_dict())


def compose(overrides: "list[str] | None" = None) -> dict[str, Any]:
    """``conf/config.yaml`` composed with Hydra-style ``overrides`` (``["layout=ddp",
    "train.steps=5"]``) into a resolved plain dict, unchecked, without starting a Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    check_overrides(list(overrides or []))
    register_defaults()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            dc = hydra_compose(config_name="config", overrides=open_overrides(list(overrides or [])))
    except HydraException as e:  # what check_overrides could not see: its first line, on one line
        raise ConfigError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    return OmegaConf.to_container(dc, resolve=True)  # type: ignore[return-value]


def load_config(overrides: "list[str] | None" = None) -> RunConfig:
    """Compose ``conf/config.yaml`` with Hydra-style ``overrides`` (``["layout=ddp",
    "train.steps=5"]``) into a validated RunConfig, without starting a Hydra app."""
    return from_dict(compose(overrides))
