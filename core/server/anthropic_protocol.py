"""The bodies of Anthropic's Messages API (``/v1/messages`` and
``/v1/messages/count_tokens``) and how one becomes the ``ChatCompletionRequest`` that runs
it: ``system`` a system message, ``messages`` (text, ``tool_use`` and ``tool_result``
blocks) the chat messages they stand for, consecutive turns of one role merged, the
sampling fields and ``tools``/``tool_choice`` the chat's. No reply shaping here
(core/server/anthropic.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.protocol import RequestError

# The chat body's fields as a Messages body names them, for the errors they raise.
FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


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
