"""The body of OpenAI's Responses API (``POST /v1/responses``) and the chat body it runs as.

A Responses body is a conversation: ``instructions`` become a system message, ``input`` (a
string, or message, ``function_call`` and ``function_call_output`` items) the messages after
it, and the sampling fields map onto a ``ChatCompletionRequest`` that runs exactly as
``/v1/chat/completions`` would run it (chat_shaped.py). Nothing is stored:
``previous_response_id`` is refused (send the conversation in ``input``), and ``store`` is
accepted but keeps nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.protocol import RequestError

# The chat body's fields as a Responses body names them, for the errors they raise.
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
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
            "\n".join(part.text for part in item.content if isinstance(part, InputText))
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
