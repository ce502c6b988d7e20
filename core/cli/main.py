"""``engine``: the command line. ``engine --help`` and ``engine backends`` import no torch,
so a backend plugin can still set its environment before torch loads."""

from __future__ import annotations

import argparse
import sys

# The serve pieces, importable from here as before (tests, scripts).
from cadence.cli.serve import add_limit_args, bind_socket, cmd_serve, serve_app  # noqa: F401


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per sample")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="tokens generated before EOS or a stop may end a sample")
    model = "the model's generation_config.json, else %s (see --generation-config)"
    g.add_argument("--temperature", type=float, default=None,
                   help="default: " + model % "0, greedy")
    g.add_argument("--top-p", type=float, default=None, help="default: " + model % "1")
    g.add_argument("--top-k", type=int, default=None, help="default: " + model % "0, off")
    g.add_argument("--min-p", type=float, default=None, help="default: " + model % "0")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (reproducible samples)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per earlier occurrence of a token, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: " + model % "1")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None, metavar="ID",
                   help="token ids that end a sample (default: only the model's EOS)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past EOS until --max-tokens (default: off)")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each generated token's log-probability and the N most likely "
                        "tokens (default: none)")


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
    from cadence.cli.chat_session import add_chat_args
    from cadence.cli.generate import add_generate_args
    from cadence.engine_args import EngineArgs

    parser = argparse.ArgumentParser(
        prog="engine", description="cadence: LLM inference with asynchronous output processing")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of cadence, torch, Python and each backend "
                             "plugin, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and whether each can run here")

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(gen)
    add_generate_args(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template "
                                       "(reads user lines from standard input)")
    EngineArgs.add_cli_args(chat)
    add_chat_args(chat)
    _add_sampling_args(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    EngineArgs.add_cli_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's name)")
    g.add_argument("--max-pending-requests", type=int, default=None,
                   help="requests in flight beyond which new ones get HTTP 429, per "
                        "replica (default: 4 x --max-num-seqs)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas of the model behind this server, each request "
                        "routed to the least loaded one; on the CPU each replica's worker "
                        "takes its share of the cores (default: %(default)s; "
                        "docs/distributed.md)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get HTTP 413")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs / prompt_logprobs a request may ask "
                        "for; -1: the whole vocabulary, which a request asks for with -1")
    g.add_argument("--metrics-prefix", choices=("vllm", "cadence"), default="vllm",
                   help="name /metrics as vllm:* (vLLM's names, so its dashboards work) or "
                        "cadence:*")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (the default with tools), reading the "
                        "model's calls with --tool-call-parser (default: off; named and "
                        "\"required\" tool choices work without it)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=("hermes", "llama3_json", "mistral", "pythonic"),
                   help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.1/3.2 JSON), mistral, pythonic (Llama 3.2/4 "
                        "pythonic, ToolACE) (default: none)")
    g.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                   help="return a reasoning model's <think> ... </think> as "
                        "reasoning_content beside content (default: none)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under their names: a body's "
                        "model field picks one; name=path or vLLM's JSON form "
                        "'{\"name\": ..., \"path\": ...}' (implies --enable-lora)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(implies --enable-lora)")
    add_limit_args(serve)
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="server and engine log level")

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    try:
        from cadence.bench.cli import add_bench_subcommands
    except ImportError:
        add_bench_subcommands = None
    if add_bench_subcommands is not None:
        add_bench_subcommands(bench)
    for p in _all_parsers(parser):
        p.formatter_class = DefaultsHelpFormatter
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless it already speaks of its default;
    None and off switches have no value worth printing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (text and action.option_strings and action.nargs != 0
                and not any(action.default is v for v in (None, False, argparse.SUPPRESS))
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _all_parsers(sub)
    return found


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_report())
        parser.exit()


def version_report() -> str:
    """cadence's, torch's and Python's versions and each backend plugin's, read from
    package metadata so that torch is not imported."""
    import platform
    from importlib import metadata

    from cadence.plugins import get_registry

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    reg = get_registry()
    lines = [f"cadence {version('cadence')}", f"torch {version('torch')}",
             f"Python {platform.python_version()} ({sys.executable})", "backends:"]
    lines += [f"  {name}: {info.distribution} {info.version}"
              for name, info in sorted(reg.backends.items())]
    lines += [f"  {err.entry_point}: {err.distribution} (failed to load: {err.error})"
              for err in reg.errors]
    if not reg.backends and not reg.errors:
        lines.append("  (no backend plugins are installed)")
    return "\n".join(lines)


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
    for ep, (dist, why) in sorted(reg.mismatches().items()):
        rows.append((ep, "?", dist, f"entry point {why}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from cadence.cli.generate import run_generate

    return run_generate(ns)


def cmd_chat(ns: argparse.Namespace) -> int:
    from cadence.cli.chat_session import run_chat

    return run_chat(ns)


def announce_backend(ns: argparse.Namespace, reason: str) -> None:
    """Say which backend runs and why: asked for, picked by auto, or the default."""
    print(f"cadence: {describe_backend(ns.backend, reason)}", file=sys.stderr, flush=True)


def describe_backend(requested: str | None, reason: str) -> str:
    from cadence.engine_args import EngineArgs

    if requested is None:
        return f"backend {EngineArgs().backend!r} (the default; --backend picks another)"
    if requested == "auto":
        return reason
    return f"backend {requested!r} (requested with --backend)"


def print_generation_defaults(defaults: tuple) -> None:
    """Say once, at start-up, which sampling defaults the model's folder brought."""
    from cadence.generation_defaults import describe_generation_defaults

    note = describe_generation_defaults(defaults)
    if note:
        print(f"cadence: {note}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "backends":
            return cmd_backends()
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "chat":
            return cmd_chat(ns)
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
