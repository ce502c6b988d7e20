"""``engine generate``: prompts from flags or a file, one output format for any number of
prompts and samples. Nothing heavy at import: ``engine --help`` builds this parser."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO

# Per-line sampling fields a prompts file may set: the SamplingParams fields a user sets.
# (output_kind: engine generate collects whole outputs, and JSON cannot name an OutputKind.)
_ENGINE_FILLED = {"output_text_buffer_length", "output_kind"}


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """One prompt of ``engine generate`` and the sampling fields its line overrides."""

    prompt: str
    overrides: dict[str, Any]
    where: str = "--prompt"


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt (repeatable)")
    src.add_argument("--prompts-file", metavar="PATH",
                     help="one prompt per line, or JSON lines with 'prompt' plus optional "
                          "sampling fields (temperature, top_p, top_k, max_tokens, seed, stop, "
                          "n, logprobs, ...) that override the flags for that prompt; '-' reads "
                          "standard input")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt in the model's chat template as a user message")
    gen.add_argument("--output-format", choices=("text", "json"), default="text",
                     help="text: a header line per sample, then its text (and logprobs); "
                          "json: one JSON object per prompt per line")
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="print each prompt token's log-probability given the tokens "
                          "before it, and the N most likely tokens there (default: none)")


def sampling_field_names() -> list[str]:
    from cadence.sampling_params import SamplingParams

    return sorted(f.name for f in dataclasses.fields(SamplingParams)
                  if f.name not in _ENGINE_FILLED)


def read_prompts(path: str, stdin: TextIO | None = None) -> list[PromptSpec]:
    """The prompts of ``--prompts-file``: JSON lines if the first non-blank line is a JSON
    object, else one plain prompt per non-blank line. Raises ValueError naming the line."""
    if path == "-":
        lines = (stdin or sys.stdin).read().splitlines()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"--prompts-file {path!r} cannot be read: {e.strerror}") from None
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"--prompts-file {path!r} holds no prompt")
    if not _is_json_object(numbered[0][1]):
        return [PromptSpec(line, {}) for _, line in numbered]
    return [_json_line(path, i, line) for i, line in numbered]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _json_line(path: str, lineno: int, line: str) -> PromptSpec:
    where = f"--prompts-file {path!r}, line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg}); every line of a JSON "
                         "lines file must be one") from None
    if not isinstance(obj, dict):
        raise ValueError(  # noqa: TRY004 (a user mistake is a ValueError: STYLE.md)
            f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = obj.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r:.40}")
    valid = sampling_field_names()
    unknown = sorted(set(obj) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; valid fields: prompt, "
                         f"{', '.join(valid)}")
    bias = obj.get("logit_bias")
    if isinstance(bias, dict):
        from cadence.field_errors import token_id_key

        # JSON object keys are strings: token ids written as digits become ids (OpenAI's
        # form); anything else ("05" too, which would collide with "5") stays a string for
        # SamplingParams to refuse by name.
        ids = {k: token_id_key(k) for k in bias}
        obj["logit_bias"] = {k if ids[k] is None else ids[k]: v for k, v in bias.items()}
    return PromptSpec(prompt, obj, where)


def params_for(base: Any, spec: PromptSpec) -> Any:
    """``base`` with the line's overrides, validated like the Python API."""
    if not spec.overrides:
        return base
    try:
        return dataclasses.replace(base, **spec.overrides)
    # TypeError: a value of the wrong kind that fails before validation names it.
    except (ValueError, TypeError) as e:
        raise ValueError(f"{spec.where}: {e}") from None


def sample_record(c: Any, tokenizer: Any) -> dict:
    """One finished sample as plain data (the JSON output format)."""
    record = {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [_position(tid, pos, tokenizer)
                              for tid, pos in zip(c.token_ids, c.logprobs)]
    return record


def _position(token_id: int, pos: dict, tokenizer: Any) -> dict:
    def entry(tid: int, lp: Any) -> dict:
        token = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])
        return {"token_id": tid, "token": token, "logprob": lp.logprob, "rank": lp.rank}

    top = sorted(pos.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
    chosen = pos.get(token_id)
    return {**(entry(token_id, chosen) if chosen is not None else {"token_id": token_id}),
            "top_logprobs": [entry(t, lp) for t, lp in top]}


def format_text(request_id: str, record: dict) -> str:
    """A sample in the text format: a header line, the text, then one line per token when
    logprobs were asked for."""
    header = (f"[prompt {request_id}, sample {record['index']}] "
              f"finish_reason={record['finish_reason']}")
    lines = [header, record["text"]]
    lines.extend(_logprob_line(pos) for pos in record.get("logprobs", []))
    return "\n".join(lines)


def _logprob_line(pos: dict) -> str:
    top = ", ".join(f"{e['token']!r} {e['logprob']:.4f}" for e in pos["top_logprobs"])
    return (f"  logprob {pos.get('logprob', float('nan')):.4f} "
            f"{pos.get('token', '')!r} (id {pos['token_id']}); top: {top}")


def run_generate(ns: argparse.Namespace) -> int:
    from cadence.chat import render_chat
    from cadence.cli.main import (
        announce_backend,
        print_generation_defaults,
        sampling_params_from_args,
    )
    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs
    from cadence.output_state import OutputKind

    specs = read_prompts(ns.prompts_file) if ns.prompts_file else \
        [PromptSpec(p, {}) for p in ns.prompt]
    args, extra = EngineArgs.from_cli_args(ns)
    config = args.create_engine_config(extra)
    base = sampling_params_from_args(ns, dict(config.model_config.generation_defaults))
    if ns.prompt_logprobs is not None:
        base = dataclasses.replace(base, prompt_logprobs=ns.prompt_logprobs)
    # Every line is checked before the model loads: a typo on line 900 costs no start-up.
    params = [params_for(base, s) for s in specs]
    print_generation_defaults(config.model_config.generation_defaults)
    engine = LLMEngine(config)
    announce_backend(ns, engine.backend_reason)
    try:
        for i, (spec, p) in enumerate(zip(specs, params)):
            prompt: Any = spec.prompt
            if ns.chat:
                prompt = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]
                                     ).as_engine_prompt()
            engine.add_request(str(i), prompt, p, output_kind=OutputKind.FINAL_ONLY)
        # Printed in prompt order, each as soon as it and all before it are done.
        done: dict[int, Any] = {}
        printed = failed = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id)] = out
                    failed += any(c.finish_reason == "error" for c in out.outputs)
            while printed in done:
                _print_request(ns.output_format, done.pop(printed), specs[printed].prompt,
                               engine.tokenizer)
                printed += 1
    finally:
        engine.shutdown()
    if failed:
        # Printed with finish_reason=error (and logged why): a script must not read success.
        print(f"error: {failed} of {len(specs)} prompts failed", file=sys.stderr)
        return 1
    return 0


def prompt_record(out: Any, tokenizer: Any) -> list | None:
    """A request's prompt logprobs as plain data (None where none were asked for): per
    prompt token, None for the first, else the entry a sampled token's logprobs have."""
    if out.prompt_logprobs is None:
        return None
    return [None if pos is None else _position(tid, pos, tokenizer)
            for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs)]


def _print_request(fmt: str, out: Any, prompt: str, tokenizer: Any) -> None:
    records = [sample_record(c, tokenizer) for c in sorted(out.outputs, key=lambda c: c.index)]
    prompt_lp = prompt_record(out, tokenizer)
    if fmt == "json":
        print(json.dumps({"request_id": out.request_id, "prompt": prompt, "outputs": records,
                          **({"prompt_logprobs": prompt_lp} if prompt_lp is not None else {}),
                          **({"error": out.error} if out.error else {})}), flush=True)
        return
    if prompt_lp is not None:
        print(f"[prompt {out.request_id}] prompt logprobs", flush=True)
        for pos in prompt_lp[1:]:
            print(_logprob_line(pos), flush=True)
    for record in records:
        print(format_text(out.request_id, record), flush=True)
