"""OpenAI response shapes built from cadence outputs: choices, logprobs, usage, chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cadence.outputs import CompletionOutput, RequestOutput


def envelope(prefix: str, obj: str, model: str, choices: list[dict],
             usage: dict | None) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}


@dataclass(slots=True)
class Head:
    """The fields every chunk of one streamed response repeats (same id, same created)."""

    prefix: str
    obj: str
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.obj, "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


@dataclass(slots=True)
class Usage:
    """Token counts over a request's prompts and samples."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _seen: set = field(default_factory=set)

    def add(self, out: RequestOutput, delta: bool = False) -> None:
        if out.request_id not in self._seen:  # the prompt counts once per prompt
            self._seen.add(out.request_id)
            self.prompt_tokens += len(out.prompt_token_ids)
        if delta or out.finished:
            self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_logprobs(c: CompletionOutput, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists over the tokens of ``c``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids, c.logprobs or []):
        chosen = entry[tid]
        token = chosen.decoded_token or ""
        tokens.append(token)
        token_lps.append(_finite(chosen.logprob))
        tops.append({(lp.decoded_token or ""): _finite(lp.logprob)
                     for _, lp in _by_rank(entry)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, top: int) -> dict:
    """The chat shape: one entry per token with its ``top`` most likely alternatives."""
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs or []):
        chosen = entry[tid]
        content.append({
            **_token(chosen.decoded_token, chosen.logprob),
            "top_logprobs": [_token(lp.decoded_token, lp.logprob)
                             for _, lp in _by_rank(entry)
                             if lp.rank is not None and lp.rank <= top],
        })
    return {"content": content}


def chat_choice(c: CompletionOutput, top_logprobs: int | None) -> dict:
    return {"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c, top_logprobs) if top_logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def chat_delta(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def _by_rank(entry: dict) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))


def _token(text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    # -inf (a token masked out) is not valid JSON; OpenAI clients expect a number.
    return max(logprob, -9999.0)
