"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``, served the
way vLLM serves them (docs/server.md, "Tool calling").

- ``tool_choice`` naming a function: the output is constrained to that function's
  ``parameters`` schema (structured output), and becomes its arguments.
- ``"required"``: constrained to a JSON array of ``{"name", "parameters"}`` objects, one of
  the tools each (at most one with ``parallel_tool_calls: false``).
- ``"auto"``: the model writes tool calls in its own format, which a tool parser
  (``--tool-call-parser``) reads back out of the text; needs ``--enable-auto-tool-choice``.
- ``"none"``: plain text.

The tools are rendered into the prompt by the model's chat template (``tools=``), as
transformers' ``apply_chat_template`` passes them. No torch here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cadence.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, call_from
from cadence.structured_output.params import StructuredOutputsParams

__all__ = ["TOOL_PARSERS", "NamedToolChoice", "ToolCall", "ToolCallIn", "ToolDef",
           "ToolParser", "ToolStream", "constraint", "finish_reason_of", "reply_of"]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef
    # A prompt-caching hint some clients add (Anthropic's, through LiteLLM); the prefix
    # cache needs none.
    cache_control: dict[str, Any] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The definition as the chat template reads it: the hint is no part of it (it
        would change the prompt, and the prefix cache's hits with it)."""
        return self.model_dump(exclude_none=True, exclude={"cache_control"})


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
    # Left in calls a client rebuilt from a stream's deltas.
    index: int | None = None

    def as_template_dict(self) -> dict[str, Any]:
        # Templates write the arguments with ``tojson``: a dict, where the JSON parses
        # (vLLM hands them over the same way), else the string as it came.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def _parameters(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def constraint(tools: list[ToolDef], choice: str | NamedToolChoice, parallel: bool
               ) -> StructuredOutputsParams | None:
    """The structured-output constraint ``choice`` puts on the output, or None.

    The JSON is compact (no whitespace between its tokens, as vLLM lays it out): arguments
    are read by programs, and a grammar that allows any whitespace lets a weak model spend
    every token it has on it and end cut short, with no call."""
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_parameters(fn), disable_any_whitespace=True)
    if choice != "required":
        return None
    # A tool's definitions ("#/$defs/X" references) move to the root, where its references
    # still find them once its schema sits inside the array's.
    shared: dict[str, dict[str, Any]] = {}
    one_of = []
    for t in tools:
        params = dict(_parameters(t.function))
        for key in ("$defs", "definitions"):
            shared.setdefault(key, {}).update(params.pop(key, None) or {})
        one_of.append({"type": "object",
                       "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                      "parameters": params},
                       "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"anyOf": one_of} if len(one_of) > 1 else one_of[0],
                              **{key: defs for key, defs in shared.items() if defs}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def calls_from_constrained(choice: str | NamedToolChoice, text: str) -> list[ToolCall]:
    """The calls of a reply constrained by ``constraint`` (it parses by construction; a
    reply cut short by max_tokens may not, and then has none)."""
    if isinstance(choice, NamedToolChoice):
        try:
            whole = isinstance(json.loads(text), dict)
        except ValueError:
            whole = False
        return [ToolCall(choice.function.name, text)] if whole else []
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [call_from(item) for item in items] if isinstance(items, list) else []
    return [c for c in calls if c is not None]


def reply_of(choice: str | NamedToolChoice, parser: ToolParser | None, text: str,
             parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A finished reply's content and calls. A reply whose calls do not parse (cut short by
    max_tokens, or a model that wrote something else) is all content. Without ``parallel``
    (``parallel_tool_calls: false``) only the first call is kept, as vLLM keeps it, whatever
    the model wrote."""
    if isinstance(choice, NamedToolChoice) or choice == "required":
        calls = calls_from_constrained(choice, text)
        return (None, calls[:1] if not parallel else calls) if calls else (text, [])
    if choice == "auto" and parser is not None:
        content, calls = parser.extract(text)
        if calls and content is not None and not content.strip():
            content = None  # the blank line a model writes before its calls (vLLM's too)
        return content, calls if parallel else calls[:1]
    return text, []


def finish_reason_of(choice: str | NamedToolChoice, calls: list[ToolCall],
                     finish_reason: str | None) -> str | None:
    # OpenAI's: "tool_calls" where the model chose to call; a forced named call ends "stop".
    if calls and not isinstance(choice, NamedToolChoice) and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


class ToolStream:
    """A streamed reply's tool calls. Under a named choice the reply is the call's
    arguments, streamed as they come (the first delta names the function, as OpenAI's
    streams do); under "required" the calls come at the end; under "auto" content is sent
    once it cannot be part of a call (``ToolParser.streamable``) and the calls at the end."""

    def __init__(self, choice: str | NamedToolChoice, parser: ToolParser | None,
                 parallel: bool = True) -> None:
        self.choice, self.parser, self.parallel = choice, parser, parallel
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}
        self._named: dict[int, ToolCall] = {}

    def delta(self, index: int, new: str) -> dict[str, Any] | None:
        """What to send now for sample ``index``, given its newest text; None: nothing."""
        text = self._text[index] = self._text.get(index, "") + new
        if isinstance(self.choice, NamedToolChoice):
            if not new:
                return None
            if index not in self._named:
                self._named[index] = call = ToolCall(self.choice.function.name, new)
                return {"tool_calls": [call.as_json(0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}
        safe = self.parser.streamable(text) if self.choice == "auto" and self.parser else 0
        sent = self._sent.get(index, 0)
        if safe <= sent or not text[:safe].strip():
            # Blank text before calls is no content (reply_of): held until text follows.
            return None
        self._sent[index] = safe
        return {"content": text[sent:safe]}

    def finish(self, index: int, finish_reason: str | None
               ) -> tuple[dict[str, Any] | None, str | None]:
        """The last delta of sample ``index`` (the content held back, the calls not sent
        yet) and its finish reason."""
        text, sent = self._text.get(index, ""), self._sent.get(index, 0)
        if isinstance(self.choice, NamedToolChoice):
            # Its arguments went out as they came: a call cut short stays one (docs/server.md).
            calls = [self._named[index]] if index in self._named else []
            return None, finish_reason_of(self.choice, calls, finish_reason)
        content, calls = reply_of(self.choice, self.parser, text, self.parallel)
        delta: dict[str, Any] = {}
        rest = (content or "")[sent:]
        if rest:
            delta["content"] = rest
        if calls and index not in self._named:
            delta["tool_calls"] = [c.as_json(i) for i, c in enumerate(calls)]
        return delta or None, finish_reason_of(self.choice, calls, finish_reason)


def merge_call_delta(calls: list[dict], delta: dict) -> None:
    """A chat stream's tool-call delta into the calls gathered so far, by their ``index``
    (the Responses and Messages streams send each call whole)."""
    i = delta.get("index", 0)
    while len(calls) <= i:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[i]
    call["id"] = delta.get("id") or call["id"]
    fn = delta.get("function") or {}
    call["function"]["name"] = fn.get("name") or call["function"]["name"]
    call["function"]["arguments"] += fn.get("arguments") or ""
