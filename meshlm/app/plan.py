"""``meshlm plan``: the entry point over a :class:`meshlm.app.config.RunConfig`: where the
model comes from (:func:`build_model`), what the run's dtypes are, and the ``meshlm train``
command that runs the winner (:func:`train_command`)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import sys
from typing import Any, Optional, Sequence

from meshlm.core.errors import ConfigError
from meshlm.layout.mesh import MeshSpec
from meshlm.plan import search
from meshlm.plan.analytic import plan
from meshlm.plan.hardware import hardware_profile
from meshlm.plan.measure import Build
from meshlm.plan.measured import plan_model
from meshlm.plan.report import Plan, format_plan

METHODS = ("measure", "formula")


def build_model(model_cfg) -> Build:
    """The one place ``meshlm plan`` gets its model from: ``build(device) -> nn.Module``
    for the ``model`` config section (``meshlm.app.model_build.build_model``: any
    ``model._target_``; with ``model.init_from``, the Hugging Face directory's model),
    built on the meta device by the planner."""
    if model_cfg.init_from:
        from meshlm.interop.hf import model_of

        return lambda device: model_of(model_cfg.init_from)
    from meshlm.app.model_build import build_model as build

    return lambda device: build(model_cfg, device)


def from_run_config(cfg) -> dict[str, Any]:
    """What the planner needs from a :class:`meshlm.app.config.RunConfig`."""
    from meshlm.layout.precision import main_grads_allowed

    t, pc = cfg.train, cfg.plan
    devices = pc.devices
    if devices is None:
        d = cfg.mesh.as_dict()
        if -1 in d.values():
            raise ConfigError(f"mesh {cfg.mesh} has an axis of -1: set plan.devices to the number of devices")
        devices = math.prod(d.values())
    method = getattr(pc, "method", "measure")
    if method not in METHODS:
        raise ConfigError(f"plan.method={method!r}: choose measure (any model) or formula (the shipped Llama only)")
    headroom = float(getattr(pc, "headroom", 0.0))
    if not 0.0 <= headroom < 1.0:
        raise ConfigError(f"plan.headroom={headroom}: a fraction of each device's memory to keep free, in [0, 1)")
    # the formula knows the shipped Llama only; the measured planner takes any model
    llama = cfg.model.is_llama() and not cfg.model.init_from
    if method == "formula" and not llama:
        raise ConfigError(
            f"plan.method=formula plans the shipped Llama only, not model {cfg.model.label}: "
            "use plan.method=measure (the default), which plans any model"
        )
    return {
        "model": (cfg.model.label, cfg.model.llama() if llama else None),
        "devices": devices,
        "global_batch": t.batch_size,
        "seq": t.seq_len,
        "ac": t.activation_checkpointing,
        "grad_accum": t.grad_accum,
        # as meshlm.app.train (precision.shard_dtypes): float32 storage, which is the master copy,
        # used in train.param_dtype, or (ZeRO-1/2) storage in train.param_dtype with float32
        # main gradients and master, chosen per layout ("auto"; NOTE [mixed precision]);
        # gradients reduced in train.reduce_dtype
        "param_dtype": "auto" if main_grads_allowed(t) else "float32",
        "master_dtype": None,
        "compute_dtype": t.param_dtype,
        "reduce_dtype": t.reduce_dtype,
        "max_memory": pc.max_memory_per_device,
        "profile": pc.profile,
        "overlap": pc.overlap,
        "png": pc.png,
        "top": pc.top,
        "format": pc.format,
        "method": method,
        "headroom": headroom,
        # the run's offload.* settings (None: the layout's offload section), checked; each
        # candidate layout's own section is under them (meshlm.app.config.offload_spec)
        "offload": _offload_settings(cfg),
        "device_is_host": hardware_profile(pc.profile).name == "cpu",
    }


def _offload_settings(cfg) -> dict[str, Any]:
    """The run's ``offload.*`` settings, checked against the layout when it is one
    (``meshlm.app.config.offload_spec``: a ConfigError naming the key)."""
    from meshlm.app.config import offload_spec
    from meshlm.layout.rules import load_layout

    offload_spec(cfg, None if cfg.layout.name == "auto" else load_layout(cfg.layout.name))
    return dataclasses.asdict(cfg.offload)


def _measured(cfg) -> Any:
    """``plan_one(layout, sizes) -> Plan``: the measured planner for ``cfg``'s model and run."""
    from meshlm.layout.precision import shard_dtypes
    from meshlm.layout.rules import load_layout

    build, t = build_model(cfg.model), cfg.train
    settings, host = _offload_settings(cfg), hardware_profile(cfg.plan.profile).name == "cpu"

    def plan_one(layout: str, sizes: dict, offload: Any = None) -> Any:
        kw = shard_dtypes(t, load_layout(layout), sizes)
        return plan_model(
            build,
            layout,
            sizes,
            global_batch=t.batch_size,
            seq=t.seq_len,
            grad_accum=t.grad_accum,
            activation_checkpointing=t.activation_checkpointing,
            shard_kw=kw,
            name=cfg.model.label,
            pipeline=dataclasses.asdict(cfg.pipeline),
            offload=settings if offload is None else offload,
            device_is_host=host,
        )

    return plan_one


def train_command(layout: str, mesh: dict, argv: Sequence[str] = (), offload: Optional[dict] = None) -> str:
    """The ``meshlm train`` command that runs ``layout`` on ``mesh``: the overrides
    ``meshlm plan`` was given (``argv``) less those of the layout, the mesh and the plan,
    then ``offload``'s settings (``{"optimizer": "host"}``: ``offload.optimizer=host``, over
    any the overrides set), the winner's layout and every mesh axis it uses."""
    from meshlm.core.axes import MESH_AXES

    def key(a: str) -> str:
        return a.split("=", 1)[0].lstrip("+~")

    added = [f"offload.{k}={v}" for k, v in (offload or {}).items()]
    keep = [
        a
        for a in argv
        if key(a).split(".", 1)[0] not in ("layout", "mesh", "plan") and key(a) not in {key(b) for b in added}
    ]
    keep += added
    # every mesh axis the planner enumerates, so none keeps the configured mesh's size
    mesh_args = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES if a in ("dp", "fsdp", "tp") or mesh.get(a, 1) != 1]
    return " ".join(["meshlm", "train", *keep, f"layout={layout}", *mesh_args])


def plan_main(cfg, argv: Optional[Sequence[str]] = None) -> int:
    """``meshlm plan``: the plan of ``model`` under ``layout`` on ``mesh`` (text, or JSON
    with ``plan.format=json``); with ``layout=auto``, the ranked candidates and the
    winner's plan, and a PNG (``plan.png``, else ``outputs/plan/<date>/<time>/plan.png``,
    the run directory ``meshlm train`` would use under the current directory).  The text
    ends with the ``meshlm train`` command that runs the plan (``argv``: the overrides
    ``meshlm plan`` was given)."""
    import time
    from pathlib import Path

    kw = from_run_config(cfg)
    name = kw["model"][0]
    layout = cfg.layout.name
    mesh = cfg.mesh.as_dict()
    measured = _measured(cfg) if kw["method"] == "measure" else None
    if layout == "auto":
        png = kw["png"] or str(Path("outputs", "plan", *time.strftime("%Y-%m-%d %H-%M-%S").split(), "plan.png"))
        out = sys.stdout if kw["format"] == "text" else io.StringIO()
        choice = search.choose_layout(**{**_search_kwargs(kw), "png": png, "planner": measured, "out": out})
        (layout, mesh), offload = choice, getattr(choice, "offload", None)
        if kw["format"] == "text":
            print(f"(memory breakdown of these candidates: {png})\n")
    else:
        offload = None  # the run's own settings
    spec = MeshSpec.parse(mesh, kw["devices"])
    settings = {**kw["offload"], **(offload or {})}
    if measured is not None:
        p = measured(layout, dict(spec.axes), settings)
    else:
        p = formula_plan(dict(kw, offload=settings), layout, spec)
    p.model = name
    cmd = train_command(p.layout, dict(spec.axes), list(argv or ()), offload)
    if kw["format"] == "json":
        print(json.dumps(dict(p.to_json(), train_command=cmd), indent=1))
    else:
        print(format_plan(p))
        print(f"\nrun it: {cmd}")
    return 0


def _search_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """:func:`meshlm.plan.search.choose_layout`'s keywords from :func:`from_run_config`'s dict."""
    names = {
        "model": "model",
        "devices": "devices",
        "max_memory": "max_memory",
        "global_batch": "global_batch",
        "seq": "seq",
        "activation_checkpointing": "ac",
        "param_dtype": "param_dtype",
        "master_dtype": "master_dtype",
        "compute_dtype": "compute_dtype",
        "reduce_dtype": "reduce_dtype",
        "grad_accum": "grad_accum",
        "hardware": "profile",
        "overlap": "overlap",
        "png": "png",
        "top": "top",
        "headroom": "headroom",
        "offload": "offload",
    }
    return {arg: kw[key] for arg, key in names.items()}


def formula_plan(kw: dict[str, Any], layout: str, mesh) -> Plan:
    """The analytic plan (the shipped Llama) of :func:`from_run_config`'s dict ``kw``."""
    return plan(
        kw["model"][1],
        layout,
        mesh,
        global_batch=kw["global_batch"],
        seq=kw["seq"],
        activation_checkpointing=kw["ac"],
        param_dtype=kw["param_dtype"],
        master_dtype=kw["master_dtype"],
        compute_dtype=kw["compute_dtype"],
        reduce_dtype=kw["reduce_dtype"],
        grad_accum=kw["grad_accum"],
        offload=kw.get("offload"),
        device_is_host=kw.get("device_is_host", False),
    )


def choose_layout(cfg=None, **kwargs) -> tuple[str, dict[str, int]]:
    """``layout=auto``: :func:`meshlm.plan.search.choose_layout`, whose keywords the model,
    train, plan and offload sections of ``cfg`` (a :class:`meshlm.app.config.RunConfig`) replace
    when it is given (``kwargs`` then only add to them: ``png``, ``out``, ``planner``).  The
    (layout, mesh) pair it returns has an ``offload`` attribute: the offload settings the
    winner needs besides the run's (``{"optimizer": "host"}`` when nothing fits on the
    device alone), None when it needs none."""
    if cfg is None:
        return search.choose_layout(**kwargs)
    kw = from_run_config(cfg)
    planner = _measured(cfg) if kw["method"] == "measure" else kwargs.pop("planner", None)
    return search.choose_layout(**{**_search_kwargs(kw), "planner": planner, **kwargs})
