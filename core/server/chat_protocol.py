"""The /v1/chat/completions request body (OpenAI's, with vLLM's extras): messages, the chat
template options, tools and tool_choice, and its mapping to ``SamplingParams``. The fields
it shares with /v1/completions are ``protocol._Common``'s."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cadence.sampling_params import SamplingParams, is_valid_unicode
from cadence.server.protocol import RequestError, _Common, check_logprobs_count
from cadence.server.tools import NamedToolChoice, ToolCallIn, ToolDef, constraint
from cadence.structured_output.params import StructuredOutputsParams


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint; nothing to do


class RefusalPart(BaseModel):
    """OpenAI's refusal part of an assistant message sent back: its text is what the
    assistant said."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    """One message. The roles a template knows are its own business (vLLM passes any role
    on: Llama 3.1's ``ipython``, the older ``function``); "developer" reaches templates
    written before it as "system". The fields OpenAI's SDK puts on an assistant message it
    returned (``refusal``, ``annotations``, ``audio`` and ``function_call`` as null) come
    back with it, and ``reasoning_content`` (or ``reasoning``) reaches the template, which
    may render earlier thinking (vLLM passes it the same way)."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1)
    content: str | list[ContentPart | RefusalPart] | None = None
    name: str | None = None
    # An assistant message's calls, and a tool message's answer to one (tool calling).
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text if isinstance(part, ContentPart) else part.refusal
                                for part in content)  # as LLM.chat (chat.py)
        if not content and self.refusal:
            content = self.refusal
        # Templates written before the "developer" role know it as "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:  # templates that know a speaker's name use it, as in vLLM
            out["name"] = self.name
        for key in ("reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    # OpenAI's fields that ask nothing of a local server: nothing is stored, the prefix
    # cache needs no key, and no tier or safety id applies.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI's reasoning controls: the chat template reads reasoning_effort where it knows it
    # (gpt-oss), as in vLLM; verbosity has no template that reads it, and is accepted only.
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    # OpenAI's deprecated form of tools: refused by name, with what to send instead.
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's: documents for templates that take them (RAG templates: Command R, Granite).
    documents: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's template options: the last (assistant) message continued instead of a new one
    # begun, and extra variables for the template (e.g. Qwen3's enable_thinking).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reply begins with the last message's text when it has the reply's role
    # (an assistant message continued, or any last message without a generation prompt).
    echo: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check(self, max_logprobs: int) -> None:
        self._check_common(max_logprobs)
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise RequestError(f"{name} is OpenAI's deprecated form of tool calling; send "
                               "tools (and tool_choice) instead", name)
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise RequestError(f"modalities: this server writes text only, got "
                               f"{self.modalities}", "modalities")
        # Both, though max_completion_tokens wins: a bad max_tokens beside it is no less bad.
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RequestError(f"{name} must be an integer >= 1 or null, got {value}", name)
        check_template_options(self)
        self._check_tools()
        self._structured()  # a bad response_format is a 400 now
        if self.top_logprobs:  # 0 asks for nothing, with or without logprobs (OpenAI's)
            if not self.logprobs:
                raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
            check_logprobs_count("top_logprobs", self.top_logprobs, max_logprobs)

    def _check_tools(self) -> None:
        if self.tools and not is_valid_unicode(json.dumps(
                [t.model_dump() for t in self.tools], ensure_ascii=False)):
            raise RequestError("tools must be valid Unicode text (it has a lone surrogate)",
                               "tools")
        names = [t.function.name for t in self.tools or ()]
        if any(not n for n in names) or len(set(names)) != len(names):
            raise RequestError("tools must have non-empty, distinct function names",
                               "tools")
        choice = self.effective_tool_choice
        if choice != "none" and not names:
            raise RequestError(f"tool_choice {self.tool_choice_name!r} needs tools",
                               "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(f"tool_choice names the function {choice.function.name!r}, "
                               f"which is not among the tools {names}", "tool_choice")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" where tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tool_choice_name(self) -> str:
        choice = self.effective_tool_choice
        return choice if isinstance(choice, str) else f"function {choice.function.name}"

    def _structured(self) -> StructuredOutputsParams | None:
        asked = super()._structured()
        choice = self.effective_tool_choice
        tool = constraint(self.tools or [], choice, self.parallel_tool_calls) \
            if self.tools else None
        if tool is None:
            return asked
        if asked is not None:
            raise RequestError(f"tool_choice {self.tool_choice_name!r} constrains the output "
                               f"already; drop {self.structured_field}", "tool_choice")
        return tool

    @property
    def structured_field(self) -> str:
        """As the base's, but a grammar built from the tools (tool_choice "required" or a
        named function) is theirs: its errors name ``tools``."""
        asked = super().structured_field
        if getattr(self, asked, None) is None and self.tools and \
                self.effective_tool_choice not in ("auto", "none"):
            return "tools"
        return asked

    @property
    def echo_text(self) -> str:
        """What ``echo`` puts before the reply: the last message's text if it has the
        reply's role (vLLM's rule), else nothing."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        if not self.echo or last.role != role:
            return ""
        return last.as_template_dict()["content"]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field ``requested_max_tokens`` comes from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"

    def body_field(self, name: str) -> str:
        # Chat's prompt is rendered from its messages, and its logprobs count is
        # top_logprobs (logprobs is a flag here).
        return {"prompt": "messages", "max_tokens": self.max_tokens_field,
                "logprobs": "top_logprobs"}.get(name, name)

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` fill the sampling fields it leaves out."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults, self._structured(),
                              self.prompt_logprobs)


# Arguments apply_chat_template takes itself: a template variable of these names would
# collide with them (transformers raises on the duplicate) or quietly change the rendering.
_TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents",
                                "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict",
                                "return_tensors", "padding", "truncation", "max_length"})


def check_template_options(req: Any) -> None:
    """vLLM's rules for ``continue_final_message`` and ``chat_template_kwargs`` (on the
    chat endpoint and /tokenize)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError("continue_final_message needs add_generation_prompt=false (the "
                           "last message is continued, no new one begun)",
                           "continue_final_message")
    reserved = sorted(set(req.chat_template_kwargs or ()) & _TEMPLATE_RESERVED)
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {reserved}: they have fields "
                           "or meanings of their own", "chat_template_kwargs")
