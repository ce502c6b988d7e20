"""Anthropic's Messages API (``POST /v1/messages``), as vLLM and llama.cpp's server serve
it, on top of the chat endpoint's machinery (the same way as ``responses.py``).

The body maps onto a ``ChatCompletionRequest`` (core/server/anthropic_protocol.py). The reply comes back as a
``message`` with ``text``, ``thinking`` (with a reasoning parser) and ``tool_use`` content
blocks and Anthropic's ``stop_reason``; streamed, as Anthropic's events (``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from cadence.server.anthropic_protocol import FIELDS, CountTokensRequest, MessagesRequest
from cadence.server.chat_shaped import ChatShaped, ReplyContext, renamed
from cadence.server.limits import DeadlineExceeded
from cadence.server.protocol import RequestError
from cadence.server.tool_parsers import is_json
from cadence.server.tools import merge_call_delta

_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def install_count_tokens(app: FastAPI, serving: Any) -> None:
    """``POST /v1/messages/count_tokens``: the prompt's length in tokens, ``{"input_tokens":
    N}``, from the chat template and tokenizer the Messages endpoint uses; nothing runs."""

    async def count_tokens(req: CountTokensRequest) -> dict:
        try:
            chat = req.as_chat()
            serving.check_model(chat.model)
            chat.check(serving.max_logprobs)
            prompt = serving.chat_prompt(chat)
        except RequestError as e:
            raise renamed(e, FIELDS) from None
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    app.add_api_route(COUNT_TOKENS_PATH, count_tokens, methods=["POST"])

def _stop_reason(finish: str | None, stop: Any, calls: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a chat finish; a reply with calls ends
    in ``tool_use``, a forced one too (the chat endpoint says ``stop`` for that, as OpenAI)."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    if calls and finish != "length":
        return "tool_use", None
    return _STOP.get(finish or "stop", "end_turn"), None


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"] or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call["function"]["name"], "input": args if isinstance(args, dict) else {}}


def message_of(chat: dict, req: MessagesRequest, ctx: ReplyContext) -> dict:
    """A whole Messages reply from a whole chat completion."""
    (choice,) = chat["choices"]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_use(c) for c in msg.get("tool_calls") or ()]
    reason, sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                    bool(msg.get("tool_calls")))
    usage = chat.get("usage") or {}
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": ctx.model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0)}}


async def message_events(chunks: AsyncIterator[dict], req: MessagesRequest,
                         ctx: ReplyContext) -> AsyncIterator[str]:
    """Anthropic's event stream from the chat stream's chunks."""
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
               "model": ctx.model, "content": [], "stop_reason": None,
               "stop_sequence": None,
               "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": 0}}
    yield event("message_start", message=message)
    open_kind, index = None, -1  # the content block being streamed
    calls: list[dict] = []
    finish, stop, usage = None, None, {}
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    for kind, key, field in (("thinking", "reasoning_content", "thinking"),
                                             ("text", "content", "text")):
                        piece = delta.get(key)
                        if not piece:
                            continue
                        if open_kind != kind:
                            if open_kind is not None:
                                yield event("content_block_stop", index=index)
                            open_kind, index = kind, index + 1
                            block = {"type": "thinking", "thinking": "", "signature": ""} \
                                if kind == "thinking" else {"type": "text", "text": ""}
                            yield event("content_block_start", index=index,
                                        content_block=block)
                        yield event("content_block_delta", index=index,
                                    delta={"type": f"{kind}_delta", field: piece})
                    for call in delta.get("tool_calls") or ():
                        merge_call_delta(calls, call)
                    if choice.get("finish_reason"):
                        finish, stop = choice["finish_reason"], choice.get("stop_reason")
        except Exception as e:  # noqa: BLE001  # a deadline or a failed request: said in-stream
            kind = "timeout_error" if isinstance(e, DeadlineExceeded) else "api_error"
            yield event("error", error={"type": kind, "message": str(e)})
            return
    if open_kind is not None:
        yield event("content_block_stop", index=index)
    for call in calls:
        index += 1
        block = _tool_use(call)
        yield event("content_block_start", index=index,
                    content_block={**block, "input": {}})
        # Arguments that do not parse (a call cut short by max_tokens) go as generated: the
        # client's partial-JSON reading makes what it can of them, as of Anthropic's own.
        arguments = call["function"]["arguments"] or ""
        partial = arguments if arguments.strip() and not is_json(arguments) else \
            json.dumps(block["input"], ensure_ascii=False)
        yield event("content_block_delta", index=index, delta={
            "type": "input_json_delta", "partial_json": partial})
        yield event("content_block_stop", index=index)
    reason, sequence = _stop_reason(finish, stop, bool(calls))
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"input_tokens": usage.get("prompt_tokens", 0),
                       "output_tokens": usage.get("completion_tokens", 0)})
    yield event("message_stop")


MESSAGES = ChatShaped("/v1/messages", MessagesRequest, FIELDS, message_of, message_events)
