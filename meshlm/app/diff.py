"""``meshlm diff``: one training step under two configurations, and the first tensor where they
disagree beyond its tolerance (docs/diff.md).

    meshlm diff [KEY=VALUE ...] [a.KEY=VALUE ...] [b.KEY=VALUE ...] [--top N] [--json PATH]

The overrides without a prefix are shared by both sides; ``a.KEY=VALUE`` and ``b.KEY=VALUE``
are side a's and side b's own (``meshlm diff model=llama_tiny a.layout=fsdp_tp
a.mesh=fsdp2_tp2 b.layout=single b.mesh=cpu1``), each side's config composed as ``meshlm
train`` composes it (conf/).  ``a=hf:PATH`` (or ``b=hf:PATH``) makes that side the Hugging
Face ``transformers`` model in PATH, and the other side loads the same weights
(``model.init_from=PATH``) unless it names its own.  Side b is the reference: the
tolerances are computed from its values.

What each side runs (``side_capture``, in every process of the side): the model of the
``model`` node built from ``train.seed`` as ``meshlm train`` builds it (NOTE [model build] in
meshlm/app/model_plain.py; or from ``model.init_from``), sharded under the side's layout on its
mesh with ``meshlm train``'s dtypes, activation checkpointing and compilation, and one step
of ``meshlm train``'s optimizer (AdamW at the first step's learning rate, clipping at
``train.grad_clip``) on the first global batch of the run's data (``train.batch_size``
sequences of ``train.seq_len``, split into ``train.grad_accum`` micro-batches and over the
data-parallel ranks as the training loop splits them; through the pipeline's schedule for a
layout with ``layers: pp`` on a mesh with pp > 1), recorded by ``meshlm.train.diff.capture_step``.  A side of more than one device runs in worker processes
started as ``meshlm train`` starts them (``meshlm.app.launch.run_workers``); a one-device
side, and the transformers side, in this process.  Where a side computes in bfloat16, the
bf16 rounding of every tensor is measured first on one device (``meshlm.train.diff.calibrate``).

``diff(overrides)`` is the Python API: it returns the ``Report`` (``run_side`` replaces how a
side runs, e.g. on a test's process pool).  ``diff_main(argv)`` is the command: it prints the
report (the first divergence, then the top N tensors by relative difference), writes it as
JSON, and returns 0 when the sides agree, 1 when they do not, 2 when they could not be
compared (a config error, a side that failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from meshlm.app.config import RunConfig
from meshlm.core.errors import ConfigError

USAGE = (
    "meshlm diff [KEY=VALUE ...] [a.KEY=VALUE ...] [b.KEY=VALUE ...] [a=hf:PATH | b=hf:PATH] [--top N] [--json PATH]"
)


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a diff: its name ("a" or "b"), its composed config, the overrides that made
    it, and the Hugging Face directory of a transformers side (None: a meshlm side)."""

    name: str
    cfg: RunConfig
    overrides: tuple[str, ...]
    hf: Optional[str] = None

    @property
    def world(self) -> int:
        """How many processes the side runs in."""
        return 1 if self.hf else self.cfg.mesh.size()


# --------------------------------------------------------------------------- spelling
def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]], dict[str, Optional[str]]]:
    """(shared, {"a": [...], "b": [...]}, {"a": hf path or None, "b": ...}) of the command's
    overrides (module docstring); a ConfigError for what is not an override."""
    shared: list[str] = []
    own: dict[str, list[str]] = {"a": [], "b": []}
    hf: dict[str, Optional[str]] = {"a": None, "b": None}
    for o in overrides:
        key, eq, value = o.partition("=")
        if not eq:
            raise ConfigError(
                f"meshlm diff: {o!r} is not an override; write KEY=VALUE (both sides), a.KEY=VALUE or b.KEY=VALUE "
                "(one side), or a=hf:PATH / b=hf:PATH (a Hugging Face model on that side)"
            )
        plain = key.lstrip("+~")
        if plain in ("a", "b"):
            if not value.startswith("hf:"):
                raise ConfigError(
                    f"meshlm diff: {o!r}: a side is given by its overrides (a.layout=fsdp_tp, ...), or as a=hf:PATH "
                    "for a Hugging Face transformers model"
                )
            hf[plain] = value[3:]
            continue
        side, dot, rest = plain.partition(".")
        if side in ("a", "b") and dot:
            own[side].append(o[: len(o) - len(o.lstrip("+~"))] + rest + "=" + value)
        else:
            shared.append(o)
    if hf["a"] and hf["b"]:
        raise ConfigError("meshlm diff: both sides are Hugging Face models (a=hf:..., b=hf:...); one must be meshlm's")
    return shared, own, hf


def sides(overrides: Sequence[str]) -> tuple[Side, Side]:
    """The two sides the command's ``overrides`` spell, configs composed and checked."""
    from meshlm.app.config import load_config

    shared, own, hf = split_overrides(overrides)
    out = []
    for name in ("a", "b"):
        over = shared + own[name]
        other_hf = hf["b" if name == "a" else "a"]
        if other_hf and not any(o.lstrip("+").startswith("model.init_from=") for o in over):
            over = over + [f"model.init_from={other_hf}"]  # the same weights as the transformers side
        try:
            cfg = load_config(over)
        except ConfigError as e:
            raise ConfigError(f"side {name} ({' '.join(over) or 'the defaults'}): {e}") from None
        out.append(Side(name, cfg, tuple(over), hf[name]))
    return out[0], out[1]


# --------------------------------------------------------------------------- one side
def global_batch(cfg: RunConfig) -> tuple:
    """The first global batch of the run's data, as ``meshlm train`` draws it: ``(tokens,
    targets[, extras])``, ``train.batch_size`` rows."""
    from meshlm.data.images import open_dataset

    t = cfg.train
    with tempfile.TemporaryDirectory() as d:
        ds = open_dataset(cfg.data, t.seq_len, cfg.model, d)
        return ds.loader("train", t.seq_len, t.batch_size, 0, 1, seed=cfg.data.seed).next()


def _rows(batch: tuple, lo: int, hi: int) -> tuple:
    """Rows ``[lo, hi)`` of every tensor of a batch (extras: a dict of tensors)."""
    out = []
    for x in batch:
        if isinstance(x, dict):
            out.append({k: v[lo:hi] for k, v in x.items()})
        else:
            out.append(x[lo:hi])
    return tuple(out)


def micro_batches(cfg: RunConfig, batch: tuple, rank: int = 0, size: int = 1, device: Any = "cpu") -> list:
    """``batch`` split into ``train.grad_accum`` micro-batches of consecutive rows, and each into
    this data-parallel rank's rows (``rank`` of ``size``), as ``(args, kwargs)`` for
    ``model(tokens, targets, **extras)`` (meshlm/train/step.py, ``model_inputs``)."""
    from meshlm.train.step import model_inputs

    t = cfg.train
    m = t.batch_size // t.grad_accum
    out = []
    for j in range(t.grad_accum):
        mb = _rows(batch, j * m, (j + 1) * m)
        lo, hi = rank * m // size, (rank + 1) * m // size
        out.append(model_inputs(_rows(mb, lo, hi), device))
    return out


def _adamw(cfg: RunConfig) -> dict:
    """``meshlm train``'s AdamW at its first step (the optim node's betas and weight decay, else torch's)."""
    from meshlm.train.step import lr_at

    t, o = cfg.train, cfg.optim.args
    return {
        "lr": lr_at(1, t),
        "betas": tuple(o.get("betas", (0.9, 0.999))),
        "weight_decay": o.get("weight_decay", 0.01),
    }


def _meta(side: Side) -> dict:
    c = side.cfg
    return {
        "side": side.name,
        "label": c.model.label,
        "layout": c.layout.name,
        "mesh": str(c.mesh),
        "compile": c.train.compile,
        "batch": f"{c.train.batch_size}x{c.train.seq_len}",
        "implementation": "meshlm",
        "overrides": list(side.overrides),
    }


def side_capture(side: Side):
    """Run and record side ``side``'s step in this process, one rank of the side (module
    docstring); every rank returns the whole capture.  A transformers side runs on its own."""
    if side.hf:
        return _transformers_capture(side)
    import torch.distributed as dist

    import meshlm.runtime.compile as compile_
    from meshlm import _torch_compat as compat
    from meshlm.app.model_build import build_pipelined, build_sharded
    from meshlm.app.train_setup import data_parallel_rank, device_for, init_process_group
    from meshlm.layout.mesh import MeshSpec, make_mesh
    from meshlm.layout.precision import shard_dtypes
    from meshlm.layout.rules import load_layout
    from meshlm.models.node import loss_of
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.offload.runtime import adamw_impl
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.runtime.pipeline import is_pipelined
    from meshlm.train.diff import capture_step

    cfg, t = side.cfg, side.cfg.train
    layout = load_layout(cfg.layout.name)
    compat.dynamo_reset()
    device = device_for(t)
    init_process_group(cfg, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    sizes = MeshSpec.parse(cfg.mesh.as_dict(), world).as_dict()
    shard_kw = dict(shard_dtypes(t, layout, sizes), overlap=t.overlap)
    pipe = None
    if is_pipelined(layout) and cfg.mesh.pp > 1:  # NOTE [pipelined step] in meshlm/runtime/pipeline/pipe.py
        pipe = build_pipelined(cfg, cfg.model, layout, device.type, seed=t.seed, **shard_kw)
        model, mesh = pipe.model, pipe.mesh
    else:
        mesh = make_mesh(cfg.mesh.as_dict(), device_type=device.type)
        model = build_sharded(cfg.model, layout, mesh, seed=t.seed, **shard_kw)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile != "none":
        comms = "eager" if pipe is not None and pipe.keep_gathered else t.compile_comms  # as meshlm train
        compile_.compile_blocks(model, t.compile, comms=comms)
    opt = ShardedOptimizer(model, torch.optim.AdamW, **_adamw(cfg), **adamw_impl(t, None, device))
    if pipe is not None:
        pipe.attach(opt)
    micro = t.batch_size // t.grad_accum
    rank, size = data_parallel_rank(layout, mesh, micro, t.seq_len)
    mbs = micro_batches(cfg, global_batch(cfg), rank, size, device)
    model.train()
    return capture_step(
        model,
        opt,
        mbs,
        seed=t.seed,
        grad_clip=t.grad_clip,
        loss_of=lambda out: loss_of(out, cfg.model),
        meta=_meta(side),
        pipeline=pipe,
    )


def _transformers_capture(side: Side):
    from meshlm.train.diff.hf import capture_transformers

    cfg = side.cfg
    meta = {**_meta(side), "label": f"hf:{side.hf}", "layout": "-", "mesh": "-"}
    return capture_transformers(
        side.hf,
        micro_batches(cfg, global_batch(cfg)),
        seed=cfg.train.seed,
        hp=_adamw(cfg),
        grad_clip=cfg.train.grad_clip,
        meta=meta,
    )


def side_worker(side: Side, path: str) -> None:
    """A worker process of a side started by ``launch_side``: record the side, rank 0 writes
    it to ``path``."""
    import torch.distributed as dist

    try:
        cap = side_capture(side)
        if dist.get_rank() == 0:
            torch.save(cap.to_state(), path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_side(side: Side):
    """Run side ``side`` as ``meshlm train`` runs a job (module docstring) and return its capture."""
    import torch.distributed as dist

    from meshlm.app.launch import check_local, run_workers
    from meshlm.train.diff import Capture

    if side.world == 1:
        started = not dist.is_initialized()
        try:
            return side_capture(side)
        finally:
            if started and dist.is_initialized():
                dist.destroy_process_group()
    check_local(side.world, f"side {side.name}'s mesh {side.cfg.mesh}", f"{side.name}.mesh")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"side_{side.name}.pt")
        run_workers(side.world, side_worker, side, path)
        return Capture.from_state(torch.load(path, weights_only=True))


def plain_model(cfg: RunConfig):
    """The side's model whole on this process, with the weights its sharded build starts from
    (NOTE [model build] in meshlm/app/model_plain.py): for measuring bf16 rounding."""
    from meshlm.app import model_plain
    from meshlm.app.model_build import build_model
    from meshlm.core.annotate import init_params

    if cfg.model.init_from:
        from meshlm.interop.hf.load import load_hf_local

        return load_hf_local(cfg.model.init_from)
    m = model_plain.build_on_host(lambda: build_model(cfg.model, "cpu"), cfg.train.seed)
    if not model_plain.lacking_init(m):
        init_params(m, cfg.train.seed)  # what the sharded build draws shard by shard
    return m


def calibration(a: Side, b: Side) -> Optional[dict]:
    """The bf16 rounding of every tensor (``meshlm.train.diff.calibrate``) where a side computes
    in bfloat16, else None."""
    from meshlm.models.node import loss_of
    from meshlm.train.diff import calibrate

    low = [s for s in (a, b) if not s.hf and s.cfg.train.param_dtype != "float32"]
    if not low:
        return None
    if any(s.cfg.train.param_dtype != "bfloat16" for s in low):
        raise ConfigError(
            "meshlm diff: train.param_dtype=float16 has no derived tolerance (float16 adds loss scaling); "
            "compare bfloat16 or float32 sides"
        )
    cfg = (b if b in low else a).cfg
    model = plain_model(cfg)
    return calibrate(
        model, micro_batches(cfg, global_batch(cfg)), seed=cfg.train.seed, loss_of=lambda o: loss_of(o, cfg.model)
    )


# --------------------------------------------------------------------------- the command
def diff(overrides: Sequence[str], *, run_side: Optional[Callable[[Side], Any]] = None):
    """The report (``meshlm.train.diff.Report``) of one step under the two configurations
    ``overrides`` spell (module docstring).  ``run_side(side)`` returns a side's
    ``Capture`` (default: ``launch_side``)."""
    from meshlm.train.diff import compare

    a, b = sides(overrides)
    cal = calibration(a, b)
    run = run_side or launch_side
    cap_a = run(a)
    cap_b = run(b)
    return compare(cap_a, cap_b, cal)


def _default_json() -> Path:
    now = datetime.datetime.now()
    return Path("outputs") / "diff" / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S") / "report.json"


def diff_main(argv: Sequence[str]) -> int:
    """``meshlm diff``: print the report, write it as JSON; 0 when the sides agree, 1 when not, 2
    when they could not be compared."""
    p = argparse.ArgumentParser(
        prog="meshlm diff",
        usage=USAGE,
        description="One training step under two configurations: the first tensor where they disagree (docs/diff.md).",
    )
    p.add_argument("--top", type=int, default=10, help="how many tensors to list by relative difference (default 10)")
    p.add_argument("--json", default=None, help="where to write the JSON report (default outputs/diff/<date>/<time>/)")
    args, overrides = p.parse_known_args(list(argv))
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    from meshlm.core.errors import MeshlmError
    from meshlm.train.diff import format_report

    try:
        report = diff(overrides)
    except MeshlmError as e:  # not a divergence: the sides could not be compared (exit 2, not 1)
        print(f"meshlm diff: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(format_report(report, args.top), flush=True)
    out = Path(args.json) if args.json else _default_json()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(args.top), indent=1, default=str) + "\n")
    print(f"\nreport: {out}", flush=True)
    sys.stdout.flush()
    return 0 if report.agree else 1
