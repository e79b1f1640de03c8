"""What a training run sets up around its loop (meshlm/app/train.py): the device and process
group, the check of the mesh against the job's processes, this rank's data-parallel rank,
the per-rank log file, rank 0's progress bar, and what a checkpoint holds besides the
tensors."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlm.app.config import RunConfig, TrainConfig
from meshlm.core.errors import ConfigError, MeshError

log = logging.getLogger("meshlm.app.train")


def data_parallel_rank(layout, mesh, batch: int, seq: int) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: the mesh axes the
    layout splits the input batch over (ranks that differ only in tp/pp/ep share a rank)."""
    from meshlm.layout.mesh import mesh_spec
    from meshlm.layout.rules import INPUT_MESH_AXES, resolve

    sizes = mesh_spec(mesh).as_dict()
    plan = resolve(
        ("batch", "seq"),
        layout.compute,
        sizes,
        shape=(batch, seq),
        what=f"input batch ({batch} sequences of {seq} tokens per micro-batch)",
        layout=layout,
        allow_mesh=INPUT_MESH_AXES,
    )
    names = list(mesh.mesh_dim_names or ())
    rank, size = 0, 1
    for a in plan[0]:
        i = names.index(a)
        rank = rank * mesh.size(i) + mesh.get_local_rank(i)
        size *= mesh.size(i)
    return rank, size


class SequenceSplit:
    """A loader whose batches are cut to this rank's share of the sequence under context
    parallel (``split_sequence``: its chunk, or its two balanced chunks); everything else
    (resume state, epochs) is the wrapped loader's."""

    def __init__(self, loader, layout, mesh):
        self.loader, self.layout, self.mesh = loader, layout, mesh

    def next(self):
        from meshlm.runtime.lowering.inputs import split_sequence

        return split_sequence(self.loader.next(), self.layout, self.mesh)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def split_for_cp(loader, layout, mesh, data_format: str):
    """``loader`` as each rank must be fed: wrapped in ``SequenceSplit`` where the mesh has a
    cp axis of more than one rank (token data only)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names or mesh.size(names.index("cp")) <= 1:
        return loader
    if data_format == "images":
        raise ConfigError(
            f"layout {layout.name} splits the sequence over cp (context parallel), which meshlm train feeds for "
            "token data only (data.format=text or tokens); use a layout without seq: cp for image-caption data"
        )
    return SequenceSplit(loader, layout, mesh)


def device_for(t: TrainConfig) -> torch.device:
    if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_process_group(cfg: RunConfig, device: torch.device) -> None:
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.train.pg_timeout_s))


def check_world(cfg: RunConfig, world_size: int) -> None:
    """A mesh whose size differs from the number of processes: say both numbers."""
    need = cfg.mesh.size(world_size)
    if need != world_size:
        raise MeshError(
            f"mesh {cfg.mesh} has {need} devices but the job has {world_size} processes; make the mesh sizes "
            f"multiply to {world_size} (e.g. mesh.dp=-1 for 'the rest'), or launch {need} processes"
        )


def logging_to(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [h]
    log.setLevel(logging.INFO)
    log.propagate = False


def progress_bar(t: TrainConfig, start: int, life):
    """rank 0's tqdm bar (None without ``train.progress`` or tqdm); the lifecycle's lines go through it."""
    if not t.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=t.steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
    life.say = bar.write
    return bar


def ckpt_state(step: int, loader, scaler) -> dict[str, Any]:
    """What a checkpoint holds besides the tensors: step, data-loader position, loss scale."""
    state = {"step": step, "loader": loader.state_dict()}
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    return state


def with_resumed_tokenizer(cfg: RunConfig) -> RunConfig:
    """``data.tokenizer=auto`` resuming a checkpoint that recorded a tokenizer (NOTE [run
    tokenizer] in meshlm/train/checkpoint/assets.py), with no ``model.init_from`` whose own
    tokenizer it would mean: that checkpoint's tokenizer."""
    import dataclasses

    from meshlm.train import lifecycle

    if cfg.data.tokenizer != "auto" or cfg.data.format != "text":
        return cfg
    init = cfg.model.init_from
    if init and (Path(init.removeprefix("hf:")) / "tokenizer.json").is_file():
        return cfg
    path = lifecycle.resume_path(cfg)
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(Path(path) / "tokenizer.json")))


def run_assets(cfg: RunConfig, resumed: "str | None") -> dict[str, str]:
    """The files the run records beside its tensors (NOTE [run tokenizer] in
    meshlm/train/checkpoint/assets.py): name -> where they are now."""
    from meshlm.data.text import HFTokenizer
    from meshlm.train.checkpoint.assets import TOKENIZER_FILES, dir_assets, hf_assets, tokenizer_assets

    out: dict[str, str] = {}
    init = cfg.model.init_from
    if init and Path(init.removeprefix("hf:")).is_dir():
        out.update(hf_assets(init.removeprefix("hf:"), tokenizer=cfg.data.tokenizer == "auto"))
    if resumed:
        out.update(dir_assets(resumed))
    tok = cfg.data.tokenizer
    if tok == "bytes" or cfg.data.format == "images":
        for name in TOKENIZER_FILES:
            out.pop(name, None)
    elif tok != "auto":
        for name in TOKENIZER_FILES:
            out.pop(name, None)
        out.update(tokenizer_assets(HFTokenizer(tok).path))
    return out


def record_assets(assets: dict[str, str], run_dir: Path, life, is_main: bool) -> None:
    """Rank 0 copies ``assets`` into the run directory; every checkpoint the run saves copies
    them from there."""
    import shutil

    if is_main:
        for name, src in assets.items():
            if Path(src).resolve() != (run_dir / name).resolve():
                shutil.copyfile(src, run_dir / name)
    if life.ckpt is not None:
        life.ckpt.assets = {name: str(run_dir / name) for name in assets}
