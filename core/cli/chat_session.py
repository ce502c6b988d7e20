"""``engine chat``: an interactive conversation through the model's chat template. Reads
user lines from standard input until EOF or ``/exit``; the reply streams as it is made."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

EXIT_COMMAND = "/exit"


def add_chat_args(chat: argparse.ArgumentParser) -> None:
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="system message that opens the conversation (default: none)")


def run_chat(ns: argparse.Namespace, stdin: TextIO | None = None) -> int:
    from cadence.chat import has_chat_template
    from cadence.cli.main import (
        announce_backend,
        print_generation_defaults,
        sampling_params_from_args,
    )
    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs

    stdin = stdin or sys.stdin
    args, extra = EngineArgs.from_cli_args(ns)
    config = args.create_engine_config(extra)
    params = sampling_params_from_args(ns, dict(config.model_config.generation_defaults))
    if params.n != 1:
        raise ValueError(f"engine chat keeps one reply per turn: --n must be 1, got {params.n}")
    print_generation_defaults(config.model_config.generation_defaults)
    engine = LLMEngine(config)
    if not has_chat_template(engine.tokenizer):
        engine.shutdown()
        raise ValueError("engine chat renders each turn with the model's chat template, and "
                         "this model's tokenizer has none; use engine generate --prompt")
    announce_backend(ns, engine.backend_reason)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    interactive = stdin.isatty()
    if interactive:
        print(f"cadence: chat; {EXIT_COMMAND} or end of input (Ctrl-D) ends it",
              file=sys.stderr)
    try:
        for turn, text in enumerate(_user_lines(stdin, interactive)):
            history.append({"role": "user", "content": text})
            reply = _reply(engine, f"chat-{turn}", history, params)
            if reply is None:
                history.pop()  # refused (e.g. too long): the user may try a shorter line
            else:
                history.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()
    return 0


def _user_lines(stdin: TextIO, interactive: bool):
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line or line.strip() == EXIT_COMMAND:
            return
        if line.strip():
            yield line.rstrip("\n")


def _reply(engine: Any, request_id: str, history: list[dict[str, str]],
           params: Any) -> str | None:
    """Stream the assistant's reply to standard output; None if the request was refused."""
    from cadence.chat import render_chat
    from cadence.output_state import OutputKind

    try:
        prompt = render_chat(engine.tokenizer, history).as_engine_prompt()
        engine.add_request(request_id, prompt, params, output_kind=OutputKind.DELTA)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return None
    parts: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                parts.append(c.text)
                print(c.text, end="", flush=True)
            if out.finished and out.error:
                print(f"\nerror: {out.error}", file=sys.stderr, flush=True)
    print(flush=True)
    return "".join(parts)
