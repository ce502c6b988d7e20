"""OpenAI's Responses API (``POST /v1/responses``): the reply reshaped from the chat
endpoint's (chat_shaped.py says how such endpoints run; the body is responses_protocol.py).

What comes back is a ``response`` object whose ``output`` holds a ``reasoning`` item (with
a reasoning parser), a ``message`` item with the text, and one ``function_call`` item per
call; streamed, the Responses event sequence (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``). Nothing is stored.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from cadence.server.chat_shaped import ChatShaped, ReplyContext
from cadence.server.limits import DeadlineExceeded
from cadence.server.responses_protocol import FIELDS, ResponsesRequest
from cadence.server.tools import merge_call_delta


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


def response_of(chat: dict, req: ResponsesRequest, ctx: ReplyContext) -> dict:
    """A whole ``response`` object from a whole chat completion."""
    resp = ResponseBuilder(req, ctx.model, ctx.count_tokens)
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


async def response_events(chunks: AsyncIterator[dict], req: ResponsesRequest,
                          ctx: ReplyContext) -> AsyncIterator[str]:
    """The Responses event stream from the chat stream's chunks."""
    resp = ResponseBuilder(req, ctx.model, ctx.count_tokens)
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
            async for chunk in chunks:
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


RESPONSES = ChatShaped("/v1/responses", ResponsesRequest, FIELDS, response_of, response_events)
