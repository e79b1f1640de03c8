"""``meshlm serve``: the model of a Hugging Face directory or a meshlm checkpoint behind an
OpenAI-compatible completions endpoint (NOTE [serving requests] in serve_http.py; NOTE
[continuous batching] in meshlm/infer/scheduler.py), on one process or
tensor parallel over workers it starts (rank 0 serves HTTP).

NOTE [stopping a server]
    SIGTERM or SIGINT (Ctrl-C) stops a server within seconds, its workers included, with
    one line naming the signal and the exit status 128 + its number (143, 130).  Rank 0
    stops taking connections and gives the requests in flight ``GRACE_S`` to finish
    (uvicorn's graceful shutdown); then the scheduler stops at its next iteration (NOTE
    [continuous batching] in meshlm/infer/scheduler.py) and the requests still open are
    cut.  The other ranks end on the signal at once (its default action, even inside a
    collective, where a Python handler would never run):
    the launcher's agent passes a signal it gets on to every worker, and Ctrl-C reaches
    them all from the terminal.  Rank 0 of several leaves with ``os._exit``: its peers are
    gone, and a teardown that waited on them would hang.  The launcher says what stopped
    the job; a worker whose launcher was killed outright stops by itself (NOTE [launcher
    death] in meshlm/app/watchdog.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Callable, Optional

from meshlm.core.errors import ConfigError

GRACE_S = 2.0  # for the requests in flight when a server is asked to stop
REPEAT_S = 3.0  # a repeat of the signal sooner than this is the same request (as lifecycle.REPEAT_S)
STOP_S = 3.0  # then for the engine to cut the rest (at their next token) and its thread to end


def parser() -> argparse.ArgumentParser:
    from meshlm.app.generate import add_compile

    p = argparse.ArgumentParser(prog="meshlm serve", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a Hugging Face directory or a meshlm checkpoint (as meshlm generate)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together, at most")
    p.add_argument("--name", default=None, help="the model's name in responses (default: the source's)")
    p.add_argument("--tokenizer", default="auto", help="as meshlm generate's --tokenizer")
    p.add_argument("--layout", default="single", help="the alias of layout=NAME: tp for tensor parallel")
    p.add_argument(
        "--mesh", default=None, help="the alias of mesh=NAME: e.g. tp=2, or pp=N with --max-memory-per-device"
    )
    p.add_argument("--max-memory-per-device", default=None, help="as meshlm generate's (placement for --max-batch)")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="the longest prompt + max_tokens served (default: the model's own, from its config; else 2048)",
    )
    p.add_argument(
        "--scheduler",
        default="continuous",
        choices=("continuous", "static"),
        help="continuous batching (the default), or static batches of the same sampling options (for comparison)",
    )
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask")
    p.add_argument("--max-prompts", type=int, default=16, help="prompts in one request, at most")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (0: no limit)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per iteration, at most")
    add_compile(p)
    p.add_argument("--offload", default="disk", choices=("disk", "host"), help="where streamed blocks live")
    p.add_argument("--offload-dir", default=None, help="the disk tier's directory")
    return p


def _serve_http(api: Any, host: str, port: int, on_stop: Callable[[], None]) -> Optional[int]:
    """uvicorn until it stops; the signal that stopped it (SIGTERM, SIGINT), or None.
    ``on_stop`` runs ``GRACE_S`` after the signal (NOTE [stopping a server])."""
    import threading
    import time

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if got and time.monotonic() - got[1] < REPEAT_S:
                return  # the same request: Ctrl-C reaches rank 0 from the terminal and from the launcher
            super().handle_exit(sig, frame)  # a later repeat: uvicorn stops waiting for requests
            if not got:
                got.extend((sig, time.monotonic()))
                timer = threading.Timer(GRACE_S, on_stop)
                timer.daemon = True
                timer.start()

    got: list = []  # the signal, when it came
    # uvicorn waits past GRACE_S only for the requests on_stop cut to end, then cancels them
    config = uvicorn.Config(api, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S + STOP_S)
    server = Server(config)
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        # uvicorn raises the signals it took again once stopped, into the handlers it found: these
        old = {s: signal.signal(s, lambda _signum, _frame: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not server.started:
        sys.exit(3)  # as uvicorn.run: it could not start (it said why)
    return got[0] if got else None


def model_context(source: Any, model: Any = None) -> tuple[Optional[int], str]:
    """The longest sequence the model reads and where its config says so: GPT-2's
    ``block_size``, or ``config.json``'s ``max_position_embeddings`` (``n_positions``);
    (None, "") where neither says."""
    import json

    from meshlm.infer.generate import context_of

    ctx = context_of(model) if model is not None else None
    if ctx is not None:
        return ctx, "model.block_size"
    cfg = source / "config.json"
    if cfg.is_file():
        d = json.loads(cfg.read_text())
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
                return d[key], f"config.json {key}"
    return None, ""


def serve_context(a: argparse.Namespace, source: Any, model: Any = None) -> int:
    """The longest prompt + max_tokens served: ``--context``, at most the model's own;
    without it the model's own, else 2048."""
    ctx, where = model_context(source, model)
    if a.context is not None:
        if a.context < 2:
            raise ConfigError(f"--context {a.context} must be at least 2 (a prompt token and a new one)")
        if ctx is not None and a.context > ctx:
            raise ConfigError(
                f"--context {a.context} exceeds the model's context of {ctx} positions ({where}): "
                f"give --context {ctx} or less"
            )
        return a.context
    return ctx if ctx is not None else 2048


def _check(a: argparse.Namespace) -> None:
    for flag, v, lo in (
        ("--max-batch", a.max_batch, 1),
        ("--max-tokens", a.max_tokens, 1),
        ("--max-prompts", a.max_prompts, 1),
        ("--prefill-chunk", a.prefill_chunk, 1),
    ):
        if v < lo:
            raise ConfigError(f"{flag}={v} must be at least {lo}")
    if not a.request_timeout >= 0:
        raise ConfigError(f"--request-timeout={a.request_timeout} must be >= 0 seconds (0: no limit)")
    if a.scheduler == "continuous" and a.compile != "none":
        raise ConfigError(
            f"--compile {a.compile} compiles the decode step of --scheduler static; the continuous scheduler "
            "decodes eagerly (docs/inference.md, Limits): drop --compile or add --scheduler static"
        )


def run(a: argparse.Namespace, launched: bool = False) -> int:
    """Serve (rank 0) or decode along (another rank); ``launched``: a worker of
    :func:`serve_main`'s own launch, whose launcher reports a stop."""
    import torch.distributed as dist

    from meshlm.app.generate import (
        _placed,
        _tokenizer,
        compile_backend,
        default_stops,
        load_model,
        source_dir,
        stopped_line,
    )
    from meshlm.app.serve_http import Limits, app
    from meshlm.infer import static
    from meshlm.infer.scheduler import Scheduler
    from meshlm.infer.step import Runner, follow

    _check(a)
    source = source_dir(a.source)
    tok = _tokenizer(a.tokenizer, source)
    off = None
    if a.max_memory_per_device is not None:  # placed for the largest batch and context served
        context = serve_context(a, source)
        model, off = _placed(a, source, a.max_batch, context, sys.stdout)
    else:
        model = load_model(source, a.layout, a.mesh or "dp=1")
        context = serve_context(a, source, model)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if ranks > 1 and dist.get_rank() > 0:
        for s in (signal.SIGTERM, signal.SIGINT):  # NOTE [stopping a server]: end at once
            signal.signal(s, signal.SIG_DFL)
        if a.scheduler == "static":
            static.follow(model, compile_backend(a))
        else:
            follow(Runner(model, a.max_batch, context))
        return 0
    if a.scheduler == "static":
        engine = static.Engine(model, a.max_batch, compile_backend(a))
    else:
        engine = Scheduler(model, a.max_batch, context, a.prefill_chunk)
    limits = Limits(context, min(a.max_tokens, context - 1), a.max_prompts, a.request_timeout or None)
    api = app(engine, tok, a.name or source.name, limits, tuple(default_stops(source)), a.max_batch)
    print(f"meshlm serve: {a.name or source.name} on http://{a.host}:{a.port}/v1/completions", flush=True)
    stopped, ended = None, True
    try:
        stopped = _serve_http(api, a.host, a.port, on_stop=lambda: engine.stop(0))
    finally:
        if stopped is None:
            engine.close()
        else:
            ended = engine.stop(STOP_S)
        if off is not None and ended:
            off.close()
    if stopped is None:
        return 0
    if not launched:
        print(stopped_line("serve", stopped), file=sys.stderr, flush=True)
    if ranks > 1 or not ended:
        sys.stdout.flush()
        os._exit(128 + stopped)  # NOTE [stopping a server]
    return 128 + stopped


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
    return run(parser().parse_args(argv), launched=True)


def serve_main(argv: list[str]) -> int:
    from meshlm.app.generate import stopped_line
    from meshlm.app.grammar import inference_argv
    from meshlm.app.launch import check_local, in_torchrun, run_workers
    from meshlm.layout.mesh import MeshSpec

    # layout=... mesh=... model.init_from=... and Hydra's flags (NOTE [one grammar] in meshlm/app/grammar.py)
    flags, runs = inference_argv(argv, "meshlm serve")
    if len(runs) != 1:
        raise ConfigError("meshlm serve: -m would serve one model after another; give one layout and one mesh")
    argv = runs[0][1]
    a = parser().parse_args(argv)
    if flags.cfg:
        print(f"source: {a.source}\nlayout: {a.layout}\nmesh: {a.mesh or 'dp=1'}")
        return 0
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(
            'meshlm serve: needs FastAPI, uvicorn and prometheus-client: pip install "meshlm[serve]"', file=sys.stderr
        )
        return 2
    n = MeshSpec.parse(a.mesh).size if a.mesh else 1
    if not in_torchrun() or os.environ.get("RANK") == "0":  # the rank that serves HTTP
        check_port(a.host, a.port)
    if n == 1 or in_torchrun():
        return run(a)
    check_local(n, f"--mesh {a.mesh}", "--mesh")
    stopped = run_workers(n, _worker, argv)
    if stopped is not None:
        print(stopped_line("serve", stopped), file=sys.stderr, flush=True)
        return 128 + stopped
    return 0
