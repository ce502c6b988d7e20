"""``/tokenize`` and ``/detokenize``: vLLM's endpoints for counting and inspecting tokens
with the served model's own tokenizer and chat template, without generating anything.

A client sizes a prompt against ``max_model_len`` before sending it, or checks what the
chat template makes of a conversation. The bodies and answers are vLLM's, so its clients
work unchanged:

- ``POST /tokenize`` with ``prompt`` (special tokens added unless ``add_special_tokens`` is
  false) or with chat ``messages`` (rendered by the template, which writes its own special
  tokens, so none are added unless asked) -> ``{"count", "max_model_len", "tokens",
  "token_strs"}``; ``token_strs`` only with ``return_token_strs``.
- ``POST /detokenize`` with ``tokens`` -> ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cadence.sampling_params import shown
from cadence.server.chat_protocol import ChatMessage, check_template_options
from cadence.server.protocol import RequestError
from cadence.server.serving import check_unicode, render_messages
from cadence.server.tools import ToolDef


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages, to turn into the model's token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # The chat endpoint's tools and template options, rendered the same way (messages only).
    tools: list[ToolDef] | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def tokenize(tokenizer: Any, max_model_len: int, req: TokenizeRequest) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        for name in ("add_generation_prompt", "tools", "continue_final_message",
                     "chat_template_kwargs"):
            if name in req.model_fields_set:
                raise RequestError(f"{name} applies to messages, not to a prompt", name)
        check_unicode(req.prompt, "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=special))
    else:
        if not req.messages:
            raise RequestError("messages must not be empty", "messages")
        check_template_options(req)
        chat = render_messages(tokenizer, req.messages, req.add_generation_prompt,
                               "tokenize a prompt instead",
                               [t.as_template_dict() for t in req.tools or ()],
                               req.continue_final_message, req.chat_template_kwargs)
        ids = chat.token_ids
        if req.add_special_tokens:
            ids = list(tokenizer.encode(chat.text, add_special_tokens=True))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                            "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return body


def detokenize(tokenizer: Any, vocab_size: int | None, req: DetokenizeRequest) -> dict:
    # The model's vocabulary may be wider than its tokenizer's (padded embeddings): ids
    # there are ones the model can be given and can produce, and decode to nothing.
    vocab = max(vocab_size or 0, len(tokenizer))
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"tokens must be in [0, {vocab}) (the model's vocabulary), "
                           f"got {shown(bad)}", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}
