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
import time
import uuid
from collections.abc import AsyncIterator
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
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier reply's output_text, sent back


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made earlier (an output item sent back as input)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses body cadence serves; any other is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
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
                messages.append(_message(item, messages))
        body: dict[str, Any] = {
            "model": self.model, "messages": [m for m in messages if m is not None],
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
    """The chat message of one input item; a function call joins the assistant message
    just before it (a reply that made several calls), or starts one."""
    if isinstance(item, MessageItem):
        content = item.content if isinstance(item.content, str) else \
            "".join(part.text for part in item.content)
        return {"role": item.role, "content": content}
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = before[-1] if before else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}


def response_field(param: str | None) -> str | None:
    """A chat body's field as the Responses body names it."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return _FIELDS.get(head, head) + dot + rest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The ``response`` object of one request, filled from the chat reply."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.status = "in_progress"
        self.incomplete: dict | None = None

    def obj(self) -> dict:
        req = self.req
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) \
            else (req.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": None, "incomplete_details": self.incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text is not None and req.text.format is not None
                                else {"type": "text"})},
            "truncation": "disabled", "usage": self.usage, "user": req.user,
            "metadata": req.metadata or {}, "store": False}

    def finish(self, finish_reason: str | None, usage: dict | None) -> None:
        self.status = "completed"
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        if usage is not None:
            self.usage = {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}


def reasoning_item(text: str) -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else ""}


def response_of(chat: dict, req: ResponsesRequest, model: str) -> dict:
    """A whole ``response`` object from a whole chat completion."""
    resp = ResponseBuilder(req, model)
    (choice,) = chat["choices"]
    message = choice["message"]
    if message.get("reasoning_content"):
        resp.output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        resp.output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        resp.output.append(call_item(call))
    resp.finish(choice["finish_reason"], chat.get("usage"))
    return resp.obj()


async def response_events(chunks: AsyncIterator[str], req: ResponsesRequest, model: str
                          ) -> AsyncIterator[str]:
    """The Responses event stream from the chat endpoint's chunks (server-sent events)."""
    resp = ResponseBuilder(req, model)
    seq = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield event("response.created", response=resp.obj())
    yield event("response.in_progress", response=resp.obj())
    text, reasoning, calls = "", "", []
    msg_id, msg_index = None, 0
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
                    reasoning += delta.get("reasoning_content") or ""
                    for call in delta.get("tool_calls") or ():
                        merge_call_delta(calls, call)
                    finish = choice.get("finish_reason") or finish
                    piece = delta.get("content")
                    if not piece:
                        continue
                    if msg_id is None:
                        if reasoning:  # the thinking is over once the answer starts
                            for e in _whole_item(event, resp, reasoning_item(reasoning)):
                                yield e
                            reasoning = ""
                        msg_id, msg_index = _id("msg"), len(resp.output)
                        resp.output.append(None)  # its place; the item is whole at the end
                        yield event("response.output_item.added", output_index=msg_index,
                                    item=message_item("", "in_progress", msg_id))
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=msg_index, content_index=0,
                                    part={"type": "output_text", "text": "",
                                          "annotations": []})
                    text += piece
                    yield event("response.output_text.delta", item_id=msg_id,
                                output_index=msg_index, content_index=0, delta=piece,
                                logprobs=[])
        except Exception as e:  # noqa: BLE001  # a deadline or a failed request: said in-stream
            timed_out = isinstance(e, DeadlineExceeded)
            yield event("error", code="request_timeout" if timed_out else "server_error",
                        message=str(e), param=None)
            resp.status = "failed"
            resp.output = [o for o in resp.output if o is not None]
            yield event("response.failed", response=resp.obj())
            return
    if reasoning:  # thinking with no answer after it
        for e in _whole_item(event, resp, reasoning_item(reasoning)):
            yield e
    if msg_id is not None:
        part = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.output_text.done", item_id=msg_id, output_index=msg_index,
                    content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=msg_index,
                    content_index=0, part=part)
        item = message_item(text, "completed", msg_id)
        resp.output[msg_index] = item
        yield event("response.output_item.done", output_index=msg_index, item=item)
    for call in calls:
        item = call_item(call)
        index = len(resp.output)
        resp.output.append(item)
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    resp.finish(finish, usage)
    yield event("response.incomplete" if resp.status == "incomplete" else
                "response.completed", response=resp.obj())


def _whole_item(event: Any, resp: ResponseBuilder, item: dict) -> list[str]:
    """An item known whole at once (the reasoning), added to ``resp`` and announced."""
    index = len(resp.output)
    resp.output.append(item)
    return [event("response.output_item.added", output_index=index,
                  item={**item, "status": "in_progress"}),
            event("response.output_item.done", output_index=index, item=item)]

