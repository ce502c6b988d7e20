"""Tool parsers: how ``tool_choice: "auto"`` reads the calls a model wrote in its own format
out of its text (``engine serve --enable-auto-tool-choice --tool-call-parser NAME``). Each
knows one family's format; ``TOOL_PARSERS`` names them. No torch here."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class ToolCall:
    """A tool call of the reply: a function name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolParser:
    """Reads the tool calls a model wrote in its own format out of its text (``auto``).

    ``extract`` splits a finished reply into its content (None when there is none) and its
    calls. ``streamable`` says how much of a reply still being written is content for sure,
    so a stream never sends text that turns out to be the start of a call.
    """

    name: ClassVar[str] = ""
    #: Whether the reply must be detokenized with its special tokens, where the markers
    #: around calls may be special tokens of the model's tokenizer.
    keeps_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        raise NotImplementedError


def call_from(obj: Any) -> ToolCall | None:
    """``{"name": ..., "arguments" (or "parameters"): {...}}`` as a call; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them
    (Hermes 2 Pro and later, Qwen2.5 and Qwen3): content is the text before the first."""

    name = "hermes"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.START)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                call = call_from(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a call after all: the reply is plain text
            calls.append(call)
        return text[:at] or None, calls

    def streamable(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        # Hold back a tail that could still grow into the marker.
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2's JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}``
    (after an optional ``<|python_tag|>``), several separated by ``;``; anything else is
    content."""

    name = "llama3_json"
    keeps_special_tokens = True
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = call_from(obj)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def streamable(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith(("{", self.TAG)) or self.TAG.startswith(body):
            return 0  # may still be a call: nothing is content yet
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
