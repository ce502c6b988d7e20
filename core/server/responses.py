"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat endpoint's machinery.

A Responses body is a conversation too: ``instructions`` become a system message, ``input``
(a string, or message, ``function_call`` and ``function_call_output`` items) the messages
after it, and the sampling fields map onto a ``ChatCompletionRequest`` that runs exactly as
``/v1/chat/completions`` would run it (chat template, tools, structured output, reasoning
parser, limits). What comes back is re-shaped: a ``response`` object whose ``output`` holds
a ``reasoning`` item (with a reasoning parser), a ``message`` item with the text, and one
``function_call`` item per call; streamed, the Responses event sequence
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

Nothing is stored: ``previous_response_id`` is refused (send the conversation in ``input``),
and ``store`` is accepted but keeps nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.limits import DeadlineExceeded
from cadence.server.protocol import RequestError
from cadence.server.tools import merge_call_delta

# The chat body's fields as a Responses body names them, for the errors they raise.
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text", "max_completion_tokens": "max_output_tokens"}


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text", "output_text"]
    text: str
    # An earlier reply's output_text, sent back as it came.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(BaseModel):
    """An earlier reply's refusal part, sent back: no text of the conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["refusal"]
    refusal: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | Refusal]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made earlier (an output item sent back as input)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning item, sent back with the rest of its output (the usual
    ``input += response.output`` loop): dropped, as chat templates drop earlier thinking."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["reasoning"]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses body cadence serves; any other is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: None = None  # a reasoning effort is not something cadence can honour
    include: list[str] | None = None
    # vLLM's extras, as on the chat endpoint.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    priority: int = 0

    def as_chat(self) -> ChatCompletionRequest:
        """The chat body that runs this request; a 400 naming the Responses field."""
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id needs responses kept by the server, and "
                               "this one keeps none: send the whole conversation in input",
                               "previous_response_id")
        if self.include:
            raise RequestError(f"include is not served (got {self.include})", "include")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise RequestError(f"max_output_tokens must be an integer >= 1 or null, got "
                               f"{self.max_output_tokens}", "max_output_tokens")
        messages = [] if self.instructions is None else \
            [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                message = _message(item, messages)
                if message is not None:
                    messages.append(message)
        body: dict[str, Any] = {
            "model": self.model, "messages": messages,
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "stream": self.stream, "user": self.user,
            "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
            "repetition_penalty": self.repetition_penalty, "priority": self.priority,
            "parallel_tool_calls": self.parallel_tool_calls}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type", "strict"})} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise RequestError("text.format of type json_schema needs a schema", "text")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_}}
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValueError as e:  # pydantic's, on a value the chat body refuses
            raise RequestError(f"input: {e}", "input") from None


def _message(item: Any, before: list[dict]) -> dict | None:
    """The chat message of one input item, or None where it joins the one before: a
    function call joins the assistant message just before it (one reply's text and its
    calls, or several calls), and an earlier reply's reasoning is dropped."""
    if isinstance(item, ReasoningItem):
        return None
    if isinstance(item, MessageItem):
        content = item.content if isinstance(item.content, str) else \
            "".join(part.text for part in item.content if isinstance(part, InputText))
        return {"role": item.role, "content": content}
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = before[-1] if before else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}


def response_error(e: RequestError) -> RequestError:
    """The chat body's error as this body names its fields (in ``param`` and the text)."""
    message, param = str(e), e.param
    if param is not None:
        head, dot, rest = param.partition(".")
        if head in _FIELDS:
            message = re.sub(rf"\b{re.escape(head)}\b", _FIELDS[head], message)
            param = _FIELDS[head] + dot + rest
    return RequestError(message, param, e.status, e.code)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The ``response`` object of one request, filled from the chat reply. ``count_tokens``
    (the tokenizer's) counts the thinking for ``reasoning_tokens``."""

    def __init__(self, req: ResponsesRequest, model: str,
                 count_tokens: Callable[[str], int] | None = None) -> None:
        self.req = req
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.count_tokens = count_tokens
        self.output: list[dict | None] = []
        self.usage: dict | None = None
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.error: dict | None = None

    def obj(self) -> dict:
        req = self.req
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) \
            else (req.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": [o for o in self.output if o is not None],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text is not None and req.text.format is not None
                                else {"type": "text"})},
            "truncation": "disabled", "usage": self.usage, "user": req.user,
            "metadata": req.metadata or {}, "store": False}

    @property
    def cut_short(self) -> bool:
        return self.status == "incomplete"

    def finish(self, finish_reason: str | None, usage: dict | None, reasoning: str) -> None:
        self.status = "completed"
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        if usage is not None:
            thought = self.count_tokens(reasoning) if reasoning and self.count_tokens else 0
            self.usage = {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {
                              "reasoning_tokens": min(thought, usage["completion_tokens"])},
                          "total_tokens": usage["total_tokens"]}

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.error = {"code": code, "message": message}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status != "in_progress" else []}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status != "in_progress" else ""}


def response_of(chat: dict, req: ResponsesRequest, model: str,
                count_tokens: Callable[[str], int] | None = None) -> dict:
    """A whole ``response`` object from a whole chat completion."""
    resp = ResponseBuilder(req, model, count_tokens)
    (choice,) = chat["choices"]
    message = choice["message"]
    reasoning = message.get("reasoning_content") or ""
    resp.finish(choice["finish_reason"], chat.get("usage"), reasoning)
    # A reply cut short by max_output_tokens: its last item is incomplete too.
    done = "incomplete" if resp.cut_short else "completed"
    if reasoning:
        resp.output.append(reasoning_item(reasoning))
    if message.get("content"):
        resp.output.append(message_item(message["content"], done))
    for call in message.get("tool_calls") or ():
        resp.output.append(call_item(call))
    return resp.obj()


class _Item:
    """One output item being streamed (reasoning or the message): announced at its first
    piece of text, each piece a delta, finished when the next item starts or at the end."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind, self.index, self.text = kind, index, ""
        self.id = _id("rs" if kind == "reasoning" else "msg")

    def item(self, status: str) -> dict:
        if self.kind == "reasoning":
            return reasoning_item(self.text, status, self.id)
        return message_item(self.text, status, self.id)

    def part(self) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": []}

    def start(self, event: Callable[..., str]) -> list[str]:
        empty = {"type": "reasoning_text", "text": ""} if self.kind == "reasoning" else \
            {"type": "output_text", "text": "", "annotations": []}
        return [event("response.output_item.added", output_index=self.index,
                      item=self.item("in_progress")),
                event("response.content_part.added", item_id=self.id,
                      output_index=self.index, content_index=0, part=empty)]

    def delta(self, event: Callable[..., str], piece: str) -> str:
        self.text += piece
        if self.kind == "reasoning":
            return event("response.reasoning_text.delta", item_id=self.id,
                         output_index=self.index, content_index=0, delta=piece)
        return event("response.output_text.delta", item_id=self.id, output_index=self.index,
                     content_index=0, delta=piece, logprobs=[])

    def finish(self, event: Callable[..., str], status: str) -> tuple[dict, list[str]]:
        if self.kind == "reasoning":
            done = event("response.reasoning_text.done", item_id=self.id,
                         output_index=self.index, content_index=0, text=self.text)
        else:
            done = event("response.output_text.done", item_id=self.id,
                         output_index=self.index, content_index=0, text=self.text,
                         logprobs=[])
        out = [done, event("response.content_part.done", item_id=self.id,
                           output_index=self.index, content_index=0, part=self.part())]
        item = self.item(status)
        out.append(event("response.output_item.done", output_index=self.index, item=item))
        return item, out


async def response_events(chunks: AsyncIterator[str], req: ResponsesRequest, model: str,
                          count_tokens: Callable[[str], int] | None = None
                          ) -> AsyncIterator[str]:
    """The Responses event stream from the chat endpoint's chunks (server-sent events)."""
    resp = ResponseBuilder(req, model, count_tokens)
    seq = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield event("response.created", response=resp.obj())
    yield event("response.in_progress", response=resp.obj())
    current: _Item | None = None
    reasoning, calls = "", []
    finish, usage = None, None
    # Closed on the way out whatever happens (a client gone closes this generator):
    # closing the chat stream aborts its request.
    async with contextlib.aclosing(chunks):
        try:
            async for raw in chunks:
                data = raw.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    for call in delta.get("tool_calls") or ():
                        merge_call_delta(calls, call)
                    finish = choice.get("finish_reason") or finish
                    for kind, key in (("reasoning", "reasoning_content"),
                                      ("message", "content")):
                        piece = delta.get(key)
                        if not piece:
                            continue
                        if current is None or current.kind != kind:
                            if current is not None:  # the thinking ends as the answer starts
                                item, events = current.finish(event, "completed")
                                resp.output[current.index] = item
                                for e in events:
                                    yield e
                            current = _Item(kind, len(resp.output))
                            resp.output.append(None)
                            for e in current.start(event):
                                yield e
                        reasoning += piece if kind == "reasoning" else ""
                        yield current.delta(event, piece)
        except Exception as e:  # noqa: BLE001  # a deadline or a failed request: said in-stream
            code = "request_timeout" if isinstance(e, DeadlineExceeded) else "server_error"
            yield event("error", code=code, message=str(e), param=None)
            if current is not None:
                resp.output[current.index] = current.item("incomplete")
            resp.fail(code, str(e))
            yield event("response.failed", response=resp.obj())
            return
    resp.finish(finish, usage, reasoning)
    if current is not None:
        status = "incomplete" if resp.cut_short and current.kind == "message" else "completed"
        item, events = current.finish(event, status)
        resp.output[current.index] = item
        for e in events:
            yield e
    for call in calls:
        item = call_item(call)
        index = len(resp.output)
        resp.output.append(item)
        yield event("response.output_item.added", output_index=index,
                    item=call_item(call, "in_progress") | {"id": item["id"]})
        yield event("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if resp.cut_short else "response.completed",
                response=resp.obj())
