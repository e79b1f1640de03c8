"""``meshlm generate``: prompts in, text out, from a Hugging Face directory or a meshlm
checkpoint, on one process or tensor parallel over several (``--layout tp --mesh tp=2``
starts one worker per rank, as ``meshlm train`` does; under torchrun each process is one).

One prompt streams its text as it is made; several are generated as one left-padded batch
and printed in order.  Every rank computes the same tokens; rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from meshlm.core.errors import ConfigError

DESCRIPTION = __doc__.split("\n\n")[0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshlm generate", description=DESCRIPTION)
    p.add_argument(
        "source",
        help="a Hugging Face directory (config.json + safetensors; hf: prefix allowed), "
        "or a meshlm checkpoint (a step_* directory, or a run's checkpoint directory: its latest)",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", help="a file of prompts, one per line")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file for a vision-language model, one per prompt in order (repeat for a batch)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the smallest set of probability >= p")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (the same on every rank)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a text that ends a completion when generated as one token (repeatable); default: the "
        "model's end-of-sequence token, if its config.json names one",
    )
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="auto (the source's tokenizer.json if it has one, else UTF-8 bytes), bytes, or a "
        "directory or file holding tokenizer.json",
    )
    p.add_argument(
        "--layout",
        default="single",
        help="the alias of layout=NAME: tp for tensor parallel (a layout that leaves the batch whole)",
    )
    p.add_argument("--mesh", default=None, help="the alias of mesh=NAME or mesh.tp=2: e.g. tp=2 (default: one process)")
    p.add_argument(
        "--max-memory-per-device",
        default=None,
        help="e.g. 2GiB: keep what fits in memory and stream the other blocks from --offload (one process)",
    )
    add_compile(p)
    p.add_argument("--offload", default="disk", choices=("disk", "host"), help="where streamed blocks live")
    p.add_argument("--offload-dir", default=None, help="the disk tier's directory (default: the temp directory)")
    p.add_argument("--plan", action="store_true", help="print the placement and exit (with --max-memory-per-device)")
    return p


def source_dir(arg: str) -> Path:
    """The SOURCE argument as a directory that exists (``hf:`` prefix allowed)."""
    path = Path(arg.removeprefix("hf:"))
    if not path.is_dir():
        raise ConfigError(
            f"{arg}: no such directory; give a Hugging Face model directory (config.json and safetensors) "
            "or a meshlm checkpoint (a step_* directory, or a run's checkpoint directory)"
        )
    return path


def _tokenizer(name: str, source: Path) -> Any:
    """``--tokenizer``: auto is the source's own: a Hugging Face directory's tokenizer.json,
    or the one a checkpoint recorded (NOTE [run tokenizer] in meshlm/train/checkpoint/assets.py);
    bytes where it has none (a run on UTF-8 bytes records none)."""
    from meshlm.data.text import ByteTokenizer, HFTokenizer
    from meshlm.train.checkpoint.assets import asset_dir

    if name == "auto":
        d = asset_dir(source)
        if d is None or not (d / "tokenizer.json").is_file():
            return ByteTokenizer()
        return HFTokenizer(str(d), key="--tokenizer")
    if name == "bytes":
        return ByteTokenizer()
    return HFTokenizer(name, key="--tokenizer")


def load_model(source: Path, layout: str = "single", mesh_shape: str = "dp=1") -> Any:
    """The model of ``source`` (a Hugging Face directory or a meshlm checkpoint) under
    ``layout`` on a mesh of ``mesh_shape``, with its weights."""
    import torch.distributed as dist

    from meshlm.layout.mesh import MeshSpec, make_mesh

    if (source / "config.json").is_file():
        from meshlm.interop.hf import load_hf
        from meshlm.interop.hf.load import load_hf_local

        if layout == "single" and MeshSpec.parse(mesh_shape).size == 1 and not dist.is_initialized():
            return load_hf_local(str(source))  # plain tensors: a compiled decode freezes them
        return load_hf(str(source), layout, make_mesh(mesh_shape))
    from meshlm.train.checkpoint import load_checkpoint
    from meshlm.train.convert import model_for_checkpoint

    ckpt, model = model_for_checkpoint(str(source), layout, mesh_shape)
    load_checkpoint(ckpt, model=model, optimizer=None, restore_rng=False)
    return model


def _meta_model(source: Path) -> Any:
    if (source / "config.json").is_file():
        from meshlm.interop.hf import model_of

        return model_of(str(source))
    from meshlm.interop.hf.family import family_of_class
    from meshlm.train.checkpoint import read_meta, resolve_path

    meta = read_meta(resolve_path(str(source)))
    fam = family_of_class(meta["model"].get("class", "Llama"))
    return fam.build(fam.config_class()(**meta["model"]["config"]))


def _devices(a: argparse.Namespace) -> int:
    """The devices a placement splits the blocks over: ``--mesh pp=N`` (default 1)."""
    from meshlm.layout.mesh import MeshSpec

    if not a.mesh:
        return 1
    spec = MeshSpec.parse(a.mesh)
    if any(n != "pp" for n, _s in spec.active()):
        raise ConfigError(
            f"--max-memory-per-device with --mesh {a.mesh}: a placement splits the blocks into one stage per "
            "process over `pp` (--mesh pp=N); tensor parallel is --layout tp --mesh tp=N without a limit"
        )
    return spec.size


def _placed(a: argparse.Namespace, source: Path, batch: int, context: int, out, plan_only: bool = False) -> Any:
    """(model, its ParamOffload or None) under --max-memory-per-device (NOTE [inference
    placement] in placement.py, NOTE [staged decoding] in stages.py); None with --plan."""
    import torch.distributed as dist

    from meshlm.infer import placement
    from meshlm.layout.mesh import init_distributed
    from meshlm.plan.search import parse_memory

    devices = _devices(a)
    cap = parse_memory(a.max_memory_per_device)
    pl = placement.place(_meta_model(source), cap, batch, context, a.offload, devices=devices)
    if plan_only:
        out.write(pl.describe() + "\n")
        return None, None
    init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(pl.describe(), file=sys.stderr)
    last = rank == devices - 1
    sw = placement.swapper(pl, a.offload_dir) if last and pl.streamed else None
    if (source / "config.json").is_file():
        from meshlm.interop.hf.load import load_hf_local

        spill = placement.spill(pl, sw) if sw is not None else None
        model = load_hf_local(str(source), after_block=spill, keep=lambda i: pl.owner(i) == rank)
    elif devices > 1:
        raise ConfigError(
            f"{source}: a placement over several processes reads a Hugging Face directory; convert the "
            "checkpoint first (meshlm convert CHECKPOINT DIR)"
        )
    else:
        model = load_model(source, "single", "dp=1")
    off = placement.stream_blocks(model, pl, sw) if sw is not None else None
    if devices > 1:
        from meshlm.infer.stages import Stages

        Stages(model, pl, rank)
    return model, off


def default_stops(source: Path) -> list[int]:
    """The end-of-sequence token(s) the source's config names: a Hugging Face directory's
    ``config.json``, a checkpoint's recorded ``hf_config.json`` (NOTE [run tokenizer]); none
    for a checkpoint of a run that recorded no config."""
    from meshlm.train.checkpoint.assets import source_config

    eos = source_config(source).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def _stops(a: argparse.Namespace, tok: Any, source: Path) -> list[int]:
    from meshlm.infer.generate import stop_id

    out = [stop_id(tok, s.encode().decode("unicode_escape"), "--stop") for s in a.stop]  # --stop '\n'
    return out or default_stops(source)


def add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        default="none",
        choices=("none", "inductor", "aot_eager"),
        help="compile the decode step (inductor on CPU freezes the weights into it, NOTE [frozen decode]: "
        "the fastest steps, after a compile of seconds to a minute)",
    )


def compile_backend(a: argparse.Namespace) -> Optional[str]:
    return None if a.compile == "none" else a.compile


def run(a: argparse.Namespace, out=None) -> int:
    """Load, generate, and (rank 0) print."""

    from meshlm.infer.sample import Sampling

    out = sys.stdout if out is None else out
    source = source_dir(a.source)
    sampling = Sampling(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    tok = _tokenizer(a.tokenizer, source)
    prompts = list(a.prompt)
    if a.prompt_file:
        if not Path(a.prompt_file).is_file():
            raise ConfigError(f"--prompt-file {a.prompt_file}: no such file (one prompt per line)")
        prompts += [line.rstrip("\n") for line in Path(a.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts and a.image:  # caption each image
        prompts = [""] * len(a.image)
    if not prompts:
        raise ConfigError("generate: no prompt: give --prompt TEXT (repeatable) or --prompt-file FILE")
    ids = [tok.encode(p).tolist() for p in prompts]
    stops = _stops(a, tok, source)
    offload = None
    if a.max_memory_per_device is not None:
        context = max(map(len, ids)) + a.max_new_tokens
        model, offload = _placed(a, source, len(ids), context, out, plan_only=a.plan)
        if model is None:
            return 0
    elif a.plan:
        raise ConfigError("--plan prints the placement --max-memory-per-device chooses: give that too")
    else:
        model = load_model(source, a.layout, a.mesh or "dp=1")
    vocab = getattr(getattr(model, "cfg", None), "vocab", None)
    if vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(
            f"--tokenizer: its vocabulary of {tok.vocab_size} tokens is larger than the model's {vocab}: "
            "this tokenizer is not the model's (pass the model's with --tokenizer)"
        )
    inputs = None
    if a.image:
        from meshlm.infer.images import image_prompts

        ids, inputs = image_prompts(model, a.image, ids)
    try:
        _generate(a, model, tok, prompts, ids, stops, sampling, out, inputs)
    finally:
        if offload is not None:
            offload.close()
    return 0


def _generate(a, model, tok, prompts, ids, stops, sampling, out, inputs=None) -> None:
    import torch.distributed as dist

    from meshlm.infer.generate import stream

    main = not dist.is_initialized() or dist.get_rank() == 0
    new: list[list[int]] = [[] for _ in prompts]
    shown = ""
    if main and len(prompts) == 1:
        out.write(prompts[0])
        out.flush()
    steps = stream(
        model,
        ids,
        max_new_tokens=a.max_new_tokens,
        sampling=sampling,
        stop=stops,
        inputs=inputs,
        compile=compile_backend(a),
    )
    for step in steps:
        for i, t in step:
            new[i].append(t)
        if main and len(prompts) == 1:  # stream: print what is now whole text
            text = tok.decode([t for t in new[0] if t not in stops])
            if not text.endswith("\ufffd"):
                out.write(text[len(shown) :])
                out.flush()
                shown = text
    if main:
        if len(prompts) == 1:
            out.write(tok.decode([t for t in new[0] if t not in stops])[len(shown) :] + "\n")
        else:
            for i, (p, n) in enumerate(zip(prompts, new)):
                out.write(f"[{i}] {p}{tok.decode([t for t in n if t not in stops])}\n")
        out.flush()


def stopped_line(cmd: str, signum: int) -> str:
    """What ``meshlm generate``/``serve`` says when SIGTERM or SIGINT stopped it."""
    import signal

    return f"meshlm {cmd}: stopped by {signal.Signals(signum).name}; exit status {128 + signum}"


def _worker(argv: list[str]) -> int:
    """One rank (its failure is reported once, by the launching process)."""
    return run(parser().parse_args(argv))


def generate_main(argv: list[str]) -> int:
    """``meshlm generate``: its flags, or ``layout=... mesh=... model.init_from=...`` and
    Hydra's ``-m``, ``--cfg job``, ``--config-dir`` (NOTE [one grammar] in meshlm/app/grammar.py)."""
    from meshlm.app.grammar import inference_argv

    flags, runs = inference_argv(argv, "meshlm generate")
    rc = 0
    for over, args in runs:
        if flags.cfg:
            a = parser().parse_args(args)
            print(f"source: {a.source}\nlayout: {a.layout}\nmesh: {a.mesh or 'dp=1'}")
            continue
        if flags.multirun:
            print(f"# meshlm generate {' '.join(over)}", flush=True)
        rc = max(rc, _generate_one(args))
    return rc


def _generate_one(argv: list[str]) -> int:
    from meshlm.app.launch import in_torchrun
    from meshlm.layout.mesh import MeshSpec

    a = parser().parse_args(argv)
    n = MeshSpec.parse(a.mesh).size if a.mesh else 1
    if n == 1 or in_torchrun() or a.plan:
        import torch.distributed as dist

        try:
            return run(a)
        finally:  # leave the process group this process made, whatever happened (as launch does)
            if dist.is_initialized():
                dist.destroy_process_group()
    from meshlm.app.launch import run_workers

    stopped = run_workers(n, _worker, argv)
    if stopped is not None:  # SIGTERM/SIGINT: the agent passed it on and the workers stopped
        print(stopped_line("generate", stopped), file=sys.stderr, flush=True)
        return 128 + stopped
    return 0
