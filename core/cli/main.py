"""``engine``: the command line. ``engine --help`` and ``engine backends`` import no torch,
so a backend plugin can still set its environment before torch loads."""

from __future__ import annotations

import argparse
import sys


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    model = "the model's generation_config.json, else %s (see --generation-config)"
    g.add_argument("--temperature", type=float, default=None,
                   help="default: " + model % "0, greedy")
    g.add_argument("--top-p", type=float, default=None, help="default: " + model % "1")
    g.add_argument("--top-k", type=int, default=None, help="default: " + model % "0, off")
    g.add_argument("--min-p", type=float, default=None, help="default: " + model % "0")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (reproducible samples)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: " + model % "1")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--logprobs", type=int, default=None)


# What `engine generate` samples with where neither a flag nor the model says: greedy, so
# that a quick try gives the same answer twice.
_CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                          "repetition_penalty": 1.0}


def sampling_params_from_args(ns: argparse.Namespace, model_defaults: dict | None = None):
    """The SamplingParams of ``engine generate``: the flags given, else ``model_defaults``
    (generation_config.json), else the CLI's greedy defaults."""
    from cadence.sampling_params import SamplingParams

    chosen = {**_CLI_SAMPLING_DEFAULTS, **(model_defaults or {})}
    chosen.update({k: getattr(ns, k) for k in _CLI_SAMPLING_DEFAULTS
                   if getattr(ns, k) is not None})
    return SamplingParams(
        n=ns.n, **chosen, seed=ns.sampling_seed, presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty, max_tokens=ns.max_tokens,
        min_tokens=ns.min_tokens, stop=ns.stop, stop_token_ids=ns.stop_token_ids,
        ignore_eos=ns.ignore_eos, logprobs=ns.logprobs)


def build_parser() -> argparse.ArgumentParser:
    from cadence.engine_args import EngineArgs

    parser = argparse.ArgumentParser(
        prog="engine", description="cadence: LLM inference with asynchronous output processing")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and whether each can run here")

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt in the model's chat template as a user message")
    _add_sampling_args(gen)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    EngineArgs.add_cli_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's name)")
    g.add_argument("--max-pending-requests", type=int, default=None,
                   help="requests in flight beyond which new ones get HTTP 429 "
                        "(default: 4 x --max-num-seqs)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get HTTP 413")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs a request may ask for")
    _add_limit_args(serve)
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    try:
        from cadence.bench.cli import add_bench_subcommands
    except ImportError:
        add_bench_subcommands = None
    if add_bench_subcommands is not None:
        add_bench_subcommands(bench)
    return parser


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
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
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (uvicorn's "
                        "option; default: %(default)s)")


def cmd_backends() -> int:
    from cadence.plugins import get_registry

    reg = get_registry()
    probes = reg.probe_all()
    rows = [("name", "version", "distribution", "status")]
    for name, info in sorted(reg.backends.items()):
        r = probes[name]
        status = (f"available ({r.reason})" if r.reason else "available") if r.available \
            else f"unavailable: {r.reason}"
        if name in reg.duplicates:
            status = f"error: {reg.duplicates[name]}"
        rows.append((name, info.version, info.distribution, status))
    for err in reg.errors:
        rows.append((err.entry_point, "?", err.distribution, f"failed to load: {err.error}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from cadence.chat import render_chat
    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs

    args, extra = EngineArgs.from_cli_args(ns)
    config = args.create_engine_config(extra)
    params = sampling_params_from_args(ns, dict(config.model_config.generation_defaults))
    _print_generation_defaults(config.model_config.generation_defaults)
    engine = LLMEngine(config)
    if args.backend == "auto":
        print(f"[{engine.backend_reason}]", file=sys.stderr)
    from cadence.output_state import OutputKind

    for i, prompt in enumerate(ns.prompt):
        if ns.chat:
            prompt = render_chat(engine.tokenizer,
                                 [{"role": "user", "content": prompt}]).as_engine_prompt()
        engine.add_request(str(i), prompt, params, output_kind=OutputKind.DELTA)
    multi = len(ns.prompt) > 1 or params.n > 1
    texts: dict[tuple[str, int], str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if not multi:
                    print(c.text, end="", flush=True)
                    if out.finished:
                        print(f"\n[finish_reason={c.finish_reason}]")
                    continue
                key = (out.request_id, c.index)
                texts[key] = texts.get(key, "") + c.text
                if out.finished:
                    print(f"[prompt {out.request_id}, sample {c.index}] "
                          f"(finish_reason={c.finish_reason}) {texts[key]!r}")
    engine.shutdown()
    return 0


def _print_generation_defaults(defaults: tuple) -> None:
    """Say once, at start-up, which sampling defaults the model's folder brought."""
    from cadence.generation_defaults import describe_generation_defaults

    note = describe_generation_defaults(defaults)
    if note:
        print(f"cadence: {note}", file=sys.stderr, flush=True)


def cmd_serve(ns: argparse.Namespace) -> int:
    import logging
    import os

    try:
        import uvicorn

        from cadence.server.app import build_app
    except ImportError as e:
        raise ValueError(f"engine serve needs the server extra: pip install "
                         f"'cadence[server]' ({e})") from None
    from cadence.async_engine import AsyncLLM
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
    args, extra = EngineArgs.from_cli_args(ns)
    pending = ns.max_pending_requests or 4 * args.max_num_seqs
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = AsyncLLM.from_engine_args(args, extra, max_pending_requests=pending)
    _print_generation_defaults(engine.generation_defaults)
    name = ns.served_model_name or os.path.basename(
        os.path.normpath(engine.engine.config.model_config.model))
    app = build_app(engine, name, ns.max_request_bytes, ns.max_logprobs, api_key, limits)
    print(f"cadence: serving {name!r} on http://{ns.host}:{ns.port}/v1 "
          f"(backend {args.backend}{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                timeout_keep_alive=ns.timeout_keep_alive)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "backends":
            return cmd_backends()
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "bench":
            return ns.bench_func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
