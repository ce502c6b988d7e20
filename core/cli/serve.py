"""``engine serve``: the server's flags, the bound socket and uvicorn around the app.

The port is bound before the model loads (a taken port is reported at once), and the
address is printed only once uvicorn accepts connections.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys


def add_limit_args(serve: argparse.ArgumentParser) -> None:
    """The server's limits (docs/server.md, "Limits") as flags of ``engine serve``."""
    g = serve.add_argument_group("limits (docs/server.md, 'Limits')")
    g.add_argument("--api-key", default=None,
                   help="bearer token every route but /health requires (HTTP 401 without "
                        "it); default: $CADENCE_API_KEY, else no key")
    g.add_argument("--default-max-tokens", type=int, default=4096,
                   help="max_tokens for a request that leaves it out (chat) or sends null: "
                        "the rest of the context, at most this many; 0: the rest of the "
                        "context (default: %(default)s)")
    g.add_argument("--max-n", type=int, default=16,
                   help="largest n (and best_of) a request may ask for; above it HTTP 400 "
                        "(default: %(default)s)")
    g.add_argument("--allow-any-temperature", action="store_true",
                   help="accept temperatures above OpenAI's 2 (otherwise HTTP 400)")
    g.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a client has to send its whole body once its headers are "
                        "in; then HTTP 408 (default: %(default)s; 0: no limit)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request still generating is aborted: HTTP "
                        "504, or an error event on a stream (unset or 0: no limit)")
    g.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection has to send a request's headers (after it "
                        "opens, or after its previous response); then HTTP 408 and the "
                        "connection closes (default: %(default)s; 0: no limit)")
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (uvicorn's "
                        "option; default: %(default)s)")


def cmd_serve(ns: argparse.Namespace) -> int:
    import logging
    import os

    try:
        import uvicorn  # noqa: F401 (checked here, used by serve_app)

        from cadence.server.app import build_app
    except ImportError as e:
        raise ValueError(f"engine serve needs the server extra: pip install "
                         f"'cadence[server]' ({e})") from None
    from cadence.async_engine import AsyncLLM
    from cadence.cli.main import describe_backend, print_generation_defaults
    from cadence.engine_args import EngineArgs
    from cadence.server.limits import ServerLimits, check_api_key

    # Checked before the model loads: a typo should not cost a minute of start-up.
    limits = ServerLimits(
        default_max_tokens=ns.default_max_tokens or None, max_n=ns.max_n,
        allow_any_temperature=ns.allow_any_temperature,
        request_body_timeout=ns.request_body_timeout or None,
        request_timeout=ns.request_timeout or None)
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("CADENCE_API_KEY")
    if api_key is not None:
        check_api_key(api_key)
    if ns.timeout_keep_alive < 0:
        raise ValueError(f"--timeout-keep-alive must be >= 0, got {ns.timeout_keep_alive}")
    if ns.enable_auto_tool_choice != (ns.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: the "
                         "parser reads the calls that auto tool choice lets the model write")
    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    if not ns.header_timeout >= 0:
        raise ValueError(f"--header-timeout must be >= 0 (0: no limit), got "
                         f"{ns.header_timeout}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {ns.port}")
    if ns.max_pending_requests is not None and ns.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {ns.max_pending_requests}")
    if ns.max_logprobs < -1:
        raise ValueError(f"--max-logprobs must be >= 0, or -1 (the whole vocabulary), got "
                         f"{ns.max_logprobs}")
    if ns.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {ns.max_request_bytes}")
    from cadence.server.lora_routes import parse_lora_modules

    lora_modules = parse_lora_modules(ns.lora_modules)
    args, extra = EngineArgs.from_cli_args(ns)
    if lora_modules or ns.allow_runtime_lora_updating:
        args.enable_lora = True
        # Before the model loads: a bad adapter should not cost a minute of start-up.
        _checked_loras(lora_modules, args.resolve_model(), args.max_lora_rank)
    pending = ns.max_pending_requests if ns.max_pending_requests is not None \
        else 4 * args.max_num_seqs
    # Bound before the model loads, so that a taken port is reported at once.
    sock = bind_socket(ns.host, ns.port)
    try:
        logging.basicConfig(level=ns.log_level.upper(),
                            format="%(levelname)s %(name)s: %(message)s")
        if ns.data_parallel_size > 1:
            from cadence.data_parallel import DataParallelAsyncLLM

            engine = DataParallelAsyncLLM.from_engine_args(
                args, extra, ns.data_parallel_size, max_pending_requests=pending)
        else:
            engine = AsyncLLM.from_engine_args(args, extra, max_pending_requests=pending)
        print_generation_defaults(engine.generation_defaults)
        name = ns.served_model_name or os.path.basename(
            os.path.normpath(engine.engine.config.model_config.model))
        app = build_app(engine, name, ns.max_request_bytes, ns.max_logprobs, api_key, limits,
                        ns.metrics_prefix, ns.tool_call_parser, ns.reasoning_parser,
                        lora_modules, ns.allow_runtime_lora_updating)
        backend = describe_backend(
            ns.backend, engine.engine.backend_reason if ns.backend == "auto" else "")
        if ns.data_parallel_size > 1:
            backend += f", {ns.data_parallel_size} replicas"
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        serve_app(app, sock, f"cadence: serving {name!r} on http://{url_host}:{port}/v1 with "
                             f"{backend}{', API key required' if api_key else ''}",
                  log_level=ns.log_level, timeout_keep_alive=ns.timeout_keep_alive,
                  **_protocol_options(ns.header_timeout))
    finally:
        sock.close()
    return 0


def _checked_loras(loras: list, model_dir: str, max_rank: int) -> list:
    """``--lora-modules`` checked against the model in ``model_dir`` at start-up: a bad
    adapter stops the server, naming it, not at its first request."""
    from cadence.lora.adapter import check_lora_architecture, read_adapter

    if loras:
        check_lora_architecture(model_dir)
    for lr in loras:
        read_adapter(lr.lora_path, model_dir, max_rank)
    return loras


def _protocol_options(header_timeout: float) -> dict:
    if not header_timeout:
        return {}
    from cadence.server.connections import header_timeout_protocol

    return {"http": header_timeout_protocol(header_timeout)}


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; ValueError naming the port if it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart must not wait for the last run's TIME_WAIT connections.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another server "
                             "listens there); pass another --port, or --port 0 for any "
                             "free one") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve_app(app: object, sock: socket.socket, message: str, **uvicorn_options: object) -> None:
    """Run ``app`` on the bound ``sock``, printing ``message`` once uvicorn accepts
    connections (not before: a client that reads it may connect right away)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(message, file=sys.stderr, flush=True)

    try:
        _Server(uvicorn.Config(app, **uvicorn_options)).run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl-C, then raises the signal again for its
        # caller; uvicorn.run swallows it the same way, and so does a clean exit here.
        pass
