"""How a body's validation errors are named (core/server/validation_errors.py): in a field
with several shapes, the branch the client meant (by the value's shape or its ``type``)
gives the error; an unknown field is named whatever it is called, with the valid fields of
the object it was found in. No engine: the body models alone."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server tests need the server extra")

from pydantic import ValidationError

from cadence.server.anthropic_protocol import MessagesRequest
from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.protocol import CompletionRequest
from cadence.server.responses_protocol import ResponsesRequest
from cadence.server.validation_errors import ErrorNamer

USER = [{"role": "user", "content": "hi"}]


def named(model: type, body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return ErrorNamer(model).name(e.value.errors())


@pytest.mark.parametrize(("model", "body", "field", "words"), [
    # An unknown field named like a class is still a field (not a union branch).
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "Foo": 1}]}]}, "messages.0.content.0.Foo",
     "valid fields: cache_control, text, type"),
    (MessagesRequest, {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "TextBlock": 1}]}]},
     "messages.0.content.0.TextBlock", "valid fields: cache_control, citations, text, type"),
    (ResponsesRequest, {"input": [{"role": "user", "content": "a", "Status": "x"}]},
     "input.0.Status", "valid fields: content, id, role, status, type"),
    # Nested unknown fields list their own object's fields, not the body's.
    (MessagesRequest, {"max_tokens": 1, "messages": USER,
                       "system": [{"type": "text", "text": "x", "foo": 1}]},
     "system.0.foo", "valid fields: cache_control, citations, text, type"),
    (ChatCompletionRequest, {"messages": USER, "tool_choice": {
        "type": "function", "function": {"name": "f", "foo": 1}}},
     "tool_choice.function.foo", "valid fields: name"),
    (CompletionRequest, {"prompt": "x", "max_token": 3}, "max_token", "max_tokens, min_p"),
    # A block without a type: the types it may have.
    (MessagesRequest, {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"text": "a"}]}]}, "messages.0.content.0.type", "'text', 'tool_use', 'tool_result'"),
    (ResponsesRequest, {"input": [{"role": "user", "content": [{"text": "a"}]}]},
     "input.0.content.0.type", "'input_text', 'output_text', 'refusal'"),
    # The shape the value has picks the branch; numbers fitting no list stay generic.
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text", "is required"),
    (CompletionRequest, {"prompt": [3, 4.5]}, "prompt", "one of: str, list[str], list[int]"),
])
def test_errors_are_named_where_the_client_went_wrong(model, body, field, words) -> None:
    got_field, message = named(model, body)
    assert got_field == field, message
    assert words in message and field in message, message
