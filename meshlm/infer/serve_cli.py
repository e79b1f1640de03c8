"""``meshlm serve``: the model of a Hugging Face directory or a meshlm checkpoint behind an
OpenAI-compatible completions endpoint (NOTE [serving loop] in serve.py), on one process or
tensor parallel over workers it starts (rank 0 serves HTTP)."""

from __future__ import annotations

import argparse
import os
import sys

from meshlm.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    from meshlm.infer.cli import add_compile

    p = argparse.ArgumentParser(prog="meshlm serve", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a Hugging Face directory or a meshlm checkpoint (as meshlm generate)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together, at most")
    p.add_argument("--name", default=None, help="the model's name in responses (default: the source's)")
    p.add_argument("--tokenizer", default="auto", help="as meshlm generate's --tokenizer")
    p.add_argument("--layout", default="single", help="tp for tensor parallel (a layout that leaves the batch whole)")
    p.add_argument("--mesh", default=None, help="e.g. tp=2, or pp=N with --max-memory-per-device")
    p.add_argument("--max-memory-per-device", default=None, help="as meshlm generate's (placement for --max-batch)")
    p.add_argument("--context", type=int, default=None, help="the longest prompt + max_tokens served (default: 2048)")
    add_compile(p)
    p.add_argument("--offload", default="disk", choices=("disk", "host"), help="where streamed blocks live")
    p.add_argument("--offload-dir", default=None, help="the disk tier's directory")
    return p


def run(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from meshlm.infer import serve
    from meshlm.infer.cli import _placed, _tokenizer, compile_backend, default_stops, load_model, source_dir
    from meshlm.infer.generate import context_of

    if a.max_batch < 1:
        raise ConfigError(f"--max-batch={a.max_batch} must be at least 1")
    source = source_dir(a.source)
    tok = _tokenizer(a.tokenizer, source)
    off = None
    if a.max_memory_per_device is not None:  # placed for the largest batch and context served
        context = a.context or 2048
        model, off = _placed(a, source, a.max_batch, context, sys.stdout)
        a.context = context
    else:
        model = load_model(source, a.layout, a.mesh or "dp=1")
    limits = [c for c in (a.context, context_of(model)) if c is not None]
    if dist.is_initialized() and dist.get_rank() > 0:
        serve.follow(model, compile_backend(a))
        return 0
    import uvicorn

    engine = serve.Engine(model, a.max_batch, compile_backend(a))
    api = serve.app(engine, tok, a.name or source.name, tuple(default_stops(source)), min(limits, default=None))
    print(f"meshlm serve: {a.name or source.name} on http://{a.host}:{a.port}/v1/completions", flush=True)
    try:
        uvicorn.run(api, host=a.host, port=a.port, log_level="warning")
    finally:
        engine.close()
        if off is not None:
            off.close()
    return 0


def check_port(host: str, port: int) -> None:
    """A ConfigError naming ``--port`` where ``host:port`` cannot be listened on (in use, a
    privileged port, a host that is not this machine's), checked by binding it as uvicorn
    will (SO_REUSEADDR), before the model loads: that takes a while, and then the server
    would print its address and fail."""
    import socket

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number; choose one in 1-65535")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, OverflowError, UnicodeError) as e:
        raise ConfigError(f"--host {host} --port {port}: not an address to listen on ({e}); check --host and --port")
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except (OSError, OverflowError) as e:
            import errno

            code = getattr(e, "errno", None)
            fix = {
                errno.EADDRINUSE: "choose another port (--port N) or stop the process that holds it",
                errno.EACCES: "ports below 1024 need privileges: choose --port 1024 or above",
            }.get(code, "check --host (an address of this machine) and --port (0-65535)")
            why = getattr(e, "strerror", None) or str(e)
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({why}); {fix}") from None


def _worker(argv: list[str]) -> int:
    return run(parser().parse_args(argv))


def serve_main(argv: list[str]) -> int:
    from meshlm.launch import check_local, in_torchrun, run_workers
    from meshlm.mesh import MeshSpec

    a = parser().parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print('meshlm serve: needs FastAPI and uvicorn: pip install "meshlm[serve]"', file=sys.stderr)
        return 2
    n = MeshSpec.parse(a.mesh).size if a.mesh else 1
    if not in_torchrun() or os.environ.get("RANK") == "0":  # the rank that serves HTTP
        check_port(a.host, a.port)
    if n == 1 or in_torchrun():
        return run(a)
    check_local(n, f"--mesh {a.mesh}", "--mesh")
    run_workers(n, _worker, argv)
    return 0
