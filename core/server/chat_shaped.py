"""Endpoints whose bodies are chat conversations in another API's shape: OpenAI's Responses
API (responses.py) and Anthropic's Messages API (anthropic.py).

Each maps its body onto a ``ChatCompletionRequest`` (the body's ``as_chat``), which then
runs exactly as ``/v1/chat/completions`` runs it, and reshapes the reply: the whole chat
completion (``whole``), or the chat stream's chunks as objects (``events``, read from
``OpenAIServing.chat_chunks``: no JSON written and parsed back). What is shared lives here
once: the route, the errors renamed to the body's fields, and what a reply needs to know.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from cadence.output_state import OutputKind
from cadence.server.limits import Deadline, ServerLimits
from cadence.server.protocol import RequestError


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """What the reshaping needs besides the chat reply."""

    model: str  # the name the reply gives
    prompt_tokens: int
    count_tokens: Callable[[str], int]  # the tokenizer's count of a text (the thinking)


@dataclass(frozen=True, slots=True)
class ChatShaped:
    """One endpoint: its path, its body (a pydantic model with ``as_chat()``), how its
    body names the chat body's fields, and how it reshapes a whole reply and a stream."""

    path: str
    body: type
    fields: dict[str, str]
    whole: Callable[[dict, Any, ReplyContext], dict]
    events: Callable[[AsyncIterator[dict], Any, ReplyContext], AsyncIterator[str]]


def renamed(e: RequestError, fields: dict[str, str]) -> RequestError:
    """The chat body's error as another body names its fields, in ``param`` and the text."""
    message, param = str(e), e.param
    if param is not None:
        head, dot, rest = param.partition(".")
        if head in fields:
            message = re.sub(rf"\b{re.escape(head)}\b", fields[head], message)
            param = fields[head] + dot + rest
    return RequestError(message, param, e.status, e.code)


def install_chat_shaped_routes(app: FastAPI, endpoints: tuple[ChatShaped, ...], serving: Any,
                               limits: ServerLimits, unless_disconnected: Callable[..., Any],
                               event_stream: Callable[[AsyncIterator[str]], Any]) -> None:
    """One POST route per endpoint (app.py's ``unless_disconnected`` and ``event_stream``
    cancel a body whose client left and guard a stream)."""
    for endpoint in endpoints:
        _add_route(app, endpoint, serving, limits, unless_disconnected, event_stream)


def _add_route(app: FastAPI, endpoint: ChatShaped, serving: Any, limits: ServerLimits,
               unless_disconnected: Callable[..., Any],
               event_stream: Callable[[AsyncIterator[str]], Any]) -> None:
    def count_tokens(text: str) -> int:
        return len(serving.tokenizer.encode(text, add_special_tokens=False))

    async def route(req: Any, raw: Request) -> Any:
        deadline = Deadline.start(limits.request_timeout)
        try:
            chat = req.as_chat()
            inputs = [serving.chat_input(chat)]
            streams = await serving.submit(inputs, chat, OutputKind.DELTA if chat.stream
                                           else OutputKind.FINAL_ONLY)
        except RequestError as e:
            raise renamed(e, endpoint.fields) from None
        ctx = ReplyContext(serving.response_model(chat), len(inputs[0][0]["prompt_token_ids"]),
                           count_tokens)
        if chat.stream:
            return event_stream(endpoint.events(
                deadline.stream(serving.chat_chunks(streams, chat)), req, ctx))
        body = await unless_disconnected(raw, deadline.run(serving.chat_body(streams, chat)))
        return endpoint.whole(body, req, ctx) if isinstance(body, dict) else body

    # FastAPI reads the body's model from the annotation.
    route.__annotations__ = {"req": endpoint.body, "raw": Request, "return": Any}
    app.add_api_route(endpoint.path, route, methods=["POST"])
