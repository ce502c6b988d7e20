"""OpenAI response shapes built from cadence outputs: choices, logprobs, usage, chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cadence.outputs import CompletionOutput, RequestOutput


def envelope(prefix: str, obj: str, model: str, choices: list[dict],
             usage: dict | None, request_id: str | None = None) -> dict:
    """A whole response; its id is ``<prefix>-<request_id>`` where the body named one
    (vLLM's ``request_id``), else a fresh one."""
    return {"id": f"{prefix}-{request_id or uuid.uuid4().hex}", "object": obj,
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage}


@dataclass(slots=True)
class Head:
    """The fields every chunk of one streamed response repeats (same id, same created)."""

    prefix: str
    obj: str
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{self.id or uuid.uuid4().hex}"  # id: the body's request_id

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


def completion_choice_of(index: int, c: CompletionOutput, logprobs: int | None,
                         echo: tuple[str, dict | None] | None, offset: int
                         ) -> tuple[dict, int]:
    """One completions choice of sample ``c`` (``echo``'s prompt text and logprobs before
    its own), and the text offset its next tokens start at."""
    text, lp = c.text, None
    if echo is not None:
        text = echo[0] + text
    if logprobs is not None:
        head = echo[1] if echo is not None else None
        lp = completion_logprobs(c, logprobs_text_length(head) if head else offset)
        if head:
            lp = join_logprobs(head, lp)
        offset = logprobs_text_length(lp) or offset
    return completion_choice(index, text, lp, c.finish_reason, c.stop_reason), offset


def completion_logprobs(c: CompletionOutput, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists over the tokens of ``c``."""
    return _legacy_logprobs(c.token_ids, c.logprobs or [], text_offset)


def echo_prefix(out: RequestOutput, echo: bool, logprobs: int | None, tokenizer: Any
                ) -> tuple[str, dict | None] | None:
    """echo=true: the prompt's text and, with logprobs, its tokens' logprobs; None
    without echo."""
    if not echo:
        return None
    text = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
    lp = None
    if logprobs is not None:
        lp = echo_logprobs(out, lambda t: tokenizer.decode([t]))
    return text, lp


def echo_logprobs(out: RequestOutput, decode: Callable[[int], str]) -> dict:
    """The prompt's tokens in the legacy completions shape (echo=true with logprobs): the
    first token has no logprob (nothing predicts it), as in OpenAI's and vLLM's replies;
    without prompt logprobs (a request that failed first) no token has one. ``decode``
    spells a token the logprobs do not."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        entries = [None] * len(ids)
    return _legacy_logprobs(ids, entries, 0, decode)


def join_logprobs(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def logprobs_text_length(lp: dict) -> int:
    """Characters the tokens of a legacy logprobs dict spell: where the next one starts."""
    return (lp["text_offset"][-1] + len(lp["tokens"][-1])) if lp["tokens"] else 0


def prompt_logprobs_json(pl: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` in a reply: per prompt token None or {token id: {logprob,
    rank, decoded_token}}."""
    if pl is None:
        return None
    return [None if d is None else {
        str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in d.items()} for d in pl]


def without_samples(out: RequestOutput) -> RequestOutput:
    """``out`` with its samples' tokens and text taken out (echo=true with max_tokens=0
    returns the prompt alone; its one generated token is not shown or counted)."""
    outputs = [replace(c, text="", token_ids=[], cumulative_logprob=None,
                       logprobs=None if c.logprobs is None else []) for c in out.outputs]
    return replace(out, outputs=outputs)


def _legacy_logprobs(token_ids: list[int], entries: list, text_offset: int,
                     decode: Callable[[int], str] | None = None) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = None if entry is None else entry[tid]
        if chosen is None:
            token = decode(tid) if decode is not None else ""
        else:
            token = chosen.decoded_token or ""
        tokens.append(token)
        token_lps.append(None if chosen is None else _finite(chosen.logprob))
        tops.append(None if entry is None else {(lp.decoded_token or ""): _finite(lp.logprob)
                                                 for _, lp in _by_rank(entry)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, top: int,
                  token_bytes: Callable[[int, str], bytes] | None = None) -> dict:
    """The chat shape: one entry per token with its ``top`` most likely alternatives;
    ``token_bytes`` gives a token's own bytes (detokenizer.token_bytes_decoder), else
    those of its text."""
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs or []):
        chosen = entry[tid]
        content.append({
            **_token(chosen.decoded_token, chosen.logprob, tid, token_bytes),
            "top_logprobs": [_token(lp.decoded_token, lp.logprob, t, token_bytes)
                             for t, lp in _by_rank(entry)
                             if lp.rank is not None and lp.rank <= top],
        })
    return {"content": content}


def chat_choice(c: CompletionOutput, top_logprobs: int | None,
                token_bytes: Callable[[int, str], bytes] | None = None) -> dict:
    return {"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c, top_logprobs, token_bytes)
            if top_logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def chat_delta(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def _by_rank(entry: dict) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))


def _token(text: str | None, logprob: float, token: int = -1,
           token_bytes: Callable[[int, str], bytes] | None = None) -> dict:
    text = text or ""
    raw = token_bytes(token, text) if token_bytes is not None else text.encode("utf-8")
    return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    # -inf (a token masked out) is not valid JSON; OpenAI clients expect a number.
    return max(logprob, -9999.0)
