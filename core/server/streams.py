"""The OpenAI endpoints' streamed replies: server-sent-event chunks for /v1/completions and
/v1/chat/completions, built from the engine's delta outputs as they come (the whole bodies
and the request preparation are in serving.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from cadence.async_engine import RequestStream
from cadence.async_stream import merge
from cadence.sampling_params import is_valid_unicode
from cadence.server import formats
from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.protocol import CompletionRequest


class StreamedReplies:
    """The streaming half of ``OpenAIServing``, which it mixes in: it reads the serving's
    ``response_model``, ``chat_top_logprobs``, ``token_bytes``, ``tokenizer`` and
    ``_reply``."""

    response_model: Any
    chat_top_logprobs: Any
    token_bytes: Any
    tokenizer: Any
    _reply: Any

    async def completion_events(self, streams: list[RequestStream], req: CompletionRequest
                                ) -> AsyncIterator[str]:
        head = formats.Head("cmpl", "text_completion", self.response_model(req),
                            req.request_id or "")
        offsets: dict[int, int] = {}
        usage = formats.Usage()
        # continuous_usage_stats: each chunk carries its choice's tokens so far (vLLM's).
        so_far: dict[int, int] = {}
        # A delta output lists only the samples with news (core/output_state.py), and a
        # finish once, so every sample it lists becomes a chunk.
        # echo=true: each stream's prompt, from its first output; each choice's first chunk
        # begins with it.
        echoes: dict[int, tuple[str, dict | None] | None] = {}
        async for i, out in merge(streams):
            if req.echo_only:
                out = formats.without_samples(out)
            usage.add(out, delta=True)
            if i not in echoes:
                echoes[i] = formats.echo_prefix(out, req.echo, req.logprobs, self.tokenizer)
            for c in out.outputs:
                index = i * req.n + c.index
                first = index not in offsets
                choice, offsets[index] = formats.completion_choice_of(
                    index, c, req.logprobs, echoes[i] if first else None,
                    offsets.get(index, 0))
                if req.return_token_ids:  # vLLM's: the prompt's with a choice's first chunk
                    if first:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                so_far[index] = so_far.get(index, 0) + len(c.token_ids)
                # echo with max_tokens=0 has nothing to send between the prompt and the end.
                if not req.echo_only or first or choice["finish_reason"]:
                    yield _sse(head.chunk([choice], _choice_usage(
                        req, len(out.prompt_token_ids), so_far[index])))
        if req.include_usage:
            yield _sse(head.chunk([], usage.as_dict()))
        yield "data: [DONE]\n\n"

    async def chat_events(self, streams: list[RequestStream], req: ChatCompletionRequest
                          ) -> AsyncIterator[str]:
        async with contextlib.aclosing(self.chat_chunks(streams, req)) as chunks:
            async for chunk in chunks:
                yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def chat_chunks(self, streams: list[RequestStream], req: ChatCompletionRequest
                          ) -> AsyncIterator[dict]:
        """The chat stream's chunks as objects: what ``chat_events`` sends, and what the
        endpoints in other APIs' shapes (chat_shaped.py) reshape without parsing JSON."""
        head = formats.Head("chatcmpl", "chat.completion.chunk", self.response_model(req),
                            req.request_id or "")
        k = self.chat_top_logprobs(req)
        for index in range(req.n):
            yield head.chunk([formats.chat_delta(index, {"role": "assistant", "content": ""},
                                                 None, None)])
        if req.echo_text:
            for index in range(req.n):
                yield head.chunk([formats.chat_delta(index, {"content": req.echo_text}, None,
                                                     None)])
        usage = formats.Usage()
        so_far: dict[int, int] = {}  # each choice's tokens, for continuous_usage_stats
        reply = self._reply(req)
        # vLLM's return_token_ids: the prompt's ids with the first chunk of output, and each
        # chunk's new ids in its choice.
        prompt_ids: list[int] | None = None
        async for _, out in merge(streams):
            usage.add(out, delta=True)
            for c in out.outputs:
                so_far[c.index] = so_far.get(c.index, 0) + len(c.token_ids)
                running = _choice_usage(req, len(out.prompt_token_ids), so_far[c.index])
                delta = reply.delta(c.index, c.text, c.finished)
                # Tokens whose text is held back (a partial character, a possible stop
                # string or tool call) still send their logprobs and ids; without either
                # they wait for text.
                if delta or (c.token_ids and (k is not None or req.return_token_ids)):
                    lp = formats.chat_logprobs(c, k, self.token_bytes) if k is not None \
                        else None
                    choice = formats.chat_delta(c.index, delta or {"content": ""}, lp, None)
                    chunk = head.chunk([choice], running)
                    if req.return_token_ids:
                        choice["token_ids"] = list(c.token_ids)
                        if prompt_ids is None:
                            prompt_ids = chunk["prompt_token_ids"] = list(out.prompt_token_ids)
                    yield chunk
                if c.finished:
                    last, finish = reply.finish(c.index, c.finish_reason)
                    if last is not None:
                        yield head.chunk([formats.chat_delta(c.index, last, None, None)],
                                         running)
                    yield head.chunk([formats.chat_delta(c.index, {}, None, finish,
                                                         c.stop_reason)], running)
        if req.include_usage:
            yield head.chunk([], usage.as_dict())


def _choice_usage(req: CompletionRequest | ChatCompletionRequest, num_prompt: int,
                  num_tokens: int) -> dict | None:
    """A chunk's usage under continuous_usage_stats: its prompt and its own choice's tokens
    so far, as vLLM counts them; None without the option."""
    if not req.continuous_usage:
        return None
    return {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
            "total_tokens": num_prompt + num_tokens}


def _sse(payload: dict) -> str:
    text = json.dumps(payload, ensure_ascii=False)
    if not is_valid_unicode(text):  # escaped, it still goes out rather than cutting the stream
        text = json.dumps(payload)
    return f"data: {text}\n\n"
