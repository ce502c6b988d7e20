"""Anthropic's Messages API (``POST /v1/messages``), as vLLM and llama.cpp's server serve
it, on top of the chat endpoint's machinery (the same way as ``responses.py``).

The body maps onto a ``ChatCompletionRequest``: ``system`` becomes a system message,
``messages`` (text, ``tool_use`` and ``tool_result`` blocks) the chat messages they stand
for, ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` the sampling
fields, and ``tools``/``tool_choice`` the chat's function tools. The reply comes back as a
``message`` with ``text``, ``thinking`` (with a reasoning parser) and ``tool_use`` content
blocks and Anthropic's ``stop_reason``; streamed, as Anthropic's events (``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.chat_shaped import ChatShaped, ReplyContext, renamed
from cadence.server.limits import DeadlineExceeded
from cadence.server.protocol import RequestError
from cadence.server.tools import merge_call_delta

# The chat body's fields as a Messages body names them, for the errors they raise.
FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint for Anthropic's cache: no meaning here
    citations: list[dict[str, Any]] | None = None  # an earlier reply's, sent back: not rendered


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(BaseModel):
    """An earlier reply's thinking, sent back: templates drop it, so it is not rendered."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    """Anthropic's encrypted thinking, sent back: nothing to render."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["redacted_thinking"]
    data: str


class UnservedBlock(BaseModel):
    """A block of a kind Anthropic serves and this server does not (a text-only model):
    parsed only to be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image", "document", "search_result", "server_tool_use",
                  "web_search_tool_result", "container_upload"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock \
    | UnservedBlock


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    """The fields of Anthropic's Messages body cadence serves; any other is a 400 naming
    it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat body that runs this request; a 400 naming the Messages field."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens}",
                               "max_tokens")
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise RequestError("thinking budgets are not served: a reasoning model thinks as "
                               "its chat template says, and its thinking comes back as a "
                               "thinking block with the server's --reasoning-parser",
                               "thinking")
        messages: list[dict] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else \
                "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        turns = _merged_turns(self.messages)
        for m in turns:
            messages.extend(_chat_messages(m))
        # A last assistant turn of text is a prefill: the reply continues it (Anthropic's).
        last = turns[-1]
        prefill = last.role == "assistant" and (isinstance(last.content, str) or not any(
            isinstance(b, ToolUseBlock) for b in last.content))
        body: dict[str, Any] = {
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
            "model": self.model, "messages": messages, "max_tokens": self.max_tokens,
            "stop": self.stop_sequences, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise RequestError("tool_choice of type tool needs the tool's name",
                                   "tool_choice")
            if choice.type in ("any", "tool") and not self.tools:
                raise RequestError(f"tool_choice of type {choice.type!r} needs tools",
                                   "tool_choice")
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required",
                                       "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValueError as e:  # pydantic's, on a value the chat body refuses
            raise RequestError(f"messages: {e}", "messages") from None


class CountTokensRequest(BaseModel):
    """Anthropic's ``/v1/messages/count_tokens`` body: what a Messages body renders into
    the prompt, without the sampling fields."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat body whose prompt is counted (as ``/v1/messages`` would render it)."""
        return MessagesRequest.model_validate(
            {**dict(self), "max_tokens": 1}).as_chat()


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


def _merged_turns(messages: list[Message]) -> list[Message]:
    """Consecutive turns of one role as one turn, their blocks in order (Anthropic combines
    them; templates that insist on alternating roles would refuse them apart)."""
    turns: list[Message] = []
    for j, m in enumerate(messages):
        for i, b in enumerate(m.content if isinstance(m.content, list) else ()):
            if isinstance(b, UnservedBlock):
                raise RequestError(f"messages.{j}.content.{i}: {b.type} "
                                   "blocks are not served (this server runs text-only "
                                   "models); send text, tool_use and tool_result blocks",
                                   f"messages.{j}.content.{i}")
        if turns and turns[-1].role == m.role:
            blocks = [_as_blocks(turns[-1].content), _as_blocks(m.content)]
            turns[-1] = Message.model_construct(role=m.role, content=blocks[0] + blocks[1])
        else:
            turns.append(m)
    return turns


def _as_blocks(content: str | list) -> list:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


def _chat_messages(m: Message) -> list[dict]:
    """The chat messages of one Messages turn: a user turn's tool results become ``tool``
    messages (before its text), an assistant turn's tool uses its ``tool_calls``."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text = "\n".join(b.text for b in m.content if isinstance(b, TextBlock))
    if m.role == "assistant":
        if any(isinstance(b, ToolResultBlock) for b in m.content):
            raise RequestError("an assistant turn cannot hold tool_result blocks (they answer "
                               "its tool_use blocks in the next user turn)", "messages")
        calls = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in m.content if isinstance(b, ToolUseBlock)]
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            content = b.content if isinstance(b.content, str) else \
                "\n".join(t.text for t in b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, ToolUseBlock):
            raise RequestError("a user turn cannot hold tool_use blocks", "messages")
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


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


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


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
        partial = arguments if arguments.strip() and not _parses(arguments) else \
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
