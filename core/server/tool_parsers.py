"""Tool parsers: how ``tool_choice: "auto"`` reads the calls a model wrote in its own format
out of its text (``engine serve --enable-auto-tool-choice --tool-call-parser NAME``). Each
knows one family's format; ``TOOL_PARSERS`` names them. No torch here."""

from __future__ import annotations

import ast
import json
import re
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cadence.sampling_params import is_valid_unicode


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


def marker_tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could still grow into ``marker``."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def _before_marker(text: str, marker: str) -> int:
    """How much of ``text`` is surely content when a call begins with ``marker``: up to
    the marker, else all but a tail that could still grow into it."""
    at = text.find(marker)
    return at if at >= 0 else len(text) - marker_tail(text, marker)


def _may_open_with(text: str, openers: tuple[str, ...]) -> bool:
    """Whether ``text`` (leading whitespace aside) opens, or may still open, with one of
    ``openers``: a reply that is all calls, whose content is nothing until that is known."""
    body = text.lstrip()
    return not body or any(body.startswith(o) or o.startswith(body) for o in openers)


def call_from(obj: Any) -> ToolCall | None:
    """``{"name": ..., "arguments" (or "parameters"): {...}}`` as a call; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str) and not is_json(args):
        # Arguments a model wrote as plain text ("Paris") go out as a JSON string, as vLLM
        # sends them, so a client's json.loads of them works; JSON text is kept as it is.
        args = json.dumps(args, ensure_ascii=False)
    try:
        call = ToolCall(obj["name"], args if isinstance(args, str)
                        else json.dumps(args, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN or an infinity: no JSON form
        return None
    return call if _sendable(call) else None


def is_json(text: str) -> bool:
    """Whether ``text`` parses as JSON (a call's arguments as the model wrote them)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _sendable(call: ToolCall) -> bool:
    """Whether the call can go out as JSON text: an escape the model wrote ("\\ud800")
    decodes to a lone surrogate, which no UTF-8 body can carry; such a reply is content."""
    return is_valid_unicode(call.name) and is_valid_unicode(call.arguments)


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
        return _before_marker(text, self.START)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2's JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}``
    (after an optional ``<|python_tag|>``), several separated by ``;`` or ``,``. Text after
    the calls is dropped, as vLLM drops it; a reply that does not open with a call is
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
        while at < len(body) and body[at] == "{":
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                break
            call = call_from(obj)
            if call is None:
                break
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;,":
                at += 1
        return (None, calls) if calls else (text, [])

    def streamable(self, text: str) -> int:
        return 0 if _may_open_with(text, ("{", self.TAG)) else len(text)


class MistralToolParser(ToolParser):
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list ``[{"name": ..., "arguments":
    {...}}, ...]`` (tokenizers before v11), or ``name[ARGS]{...}`` / ``name{...}``, one
    marker before each call (v11 and later: Mistral Small 3.2, Magistral, Devstral).
    Content is the text before the first marker; text after a call's JSON is dropped, as
    vLLM drops it. Call ids are 9 letters and digits, the only ids Mistral's chat templates
    take back."""

    name = "mistral"
    keeps_special_tokens = True
    START = "[TOOL_CALLS]"
    _ID = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*(?:\[ARGS\])?\s*(?=\{)")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.START)
        if at < 0:
            return text, []
        segments = [s for s in text[at:].split(self.START) if s.strip()]
        if not segments:
            return text, []
        calls: list[ToolCall | None]
        if segments[0].lstrip().startswith(("[", "{")):
            # The list form: one list; a later marker's text is trailing output.
            items = _first_json(segments[0])
            items = items if isinstance(items, list) else [items]
            calls = [call_from(item) for item in items]
        else:
            calls = [self._named_call(segment) for segment in segments]
        if not calls or any(c is None for c in calls):
            return text, []
        for c in calls:
            c.id = "".join(secrets.choice(self._ID) for _ in range(9))
        return (text[:at] if text[:at].strip() else None), calls

    def _named_call(self, segment: str) -> ToolCall | None:
        m = self._NAMED.match(segment)
        if m is None:
            return None
        args = _first_json(segment[m.end():])
        return call_from({"name": m.group(1), "arguments": args}) \
            if isinstance(args, dict) else None

    def streamable(self, text: str) -> int:
        return _before_marker(text, self.START)


def _first_json(text: str) -> Any:
    """The JSON value ``text`` opens with (leading whitespace aside), None where it opens
    with none; what follows it is ignored."""
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())[0]
    except ValueError:
        return None


class PythonicToolParser(ToolParser):
    """A reply that is a Python list of calls, ``[get_weather(city='Paris'), f()]``
    (Llama 3.2's and Llama 4's pythonic format, ToolACE), read with ``ast``: keyword
    arguments with literal values only."""

    name = "pythonic"
    keeps_special_tokens = True
    TAGS = ("<|python_start|>", "<|python_end|>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAGS[0]).removesuffix(self.TAGS[1]).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            # Not literals (a name, a **kwargs), literals JSON has no form for (a set,
            # bytes, a complex number, inf, a dict keyed by tuples), or unhashable keys
            # (TypeError from literal_eval): the reply is plain content, like any text
            # that does not parse as calls.
            return text, []
        return None, calls

    @staticmethod
    def _call(node: ast.expr) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call by keywords")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in args:
            raise ValueError("**kwargs")
        call = ToolCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))
        if not _sendable(call):
            raise ValueError("a lone surrogate")
        return call

    def streamable(self, text: str) -> int:
        return 0 if _may_open_with(text, ("[", self.TAGS[0])) else len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        PythonicToolParser)}
