"""/v1/embeddings: OpenAI's body (with vLLM's extra fields), its mapping to
``PoolingParams``, and the response. The engine side is cadence/pooling."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cadence.async_stream import add_all, final_outputs
from cadence.output_state import OutputKind
from cadence.outputs import EmbeddingRequestOutput
from cadence.pooling import PoolingParams
from cadence.request_intake import truncate_prompt, truncate_text_prompt, truncation_length
from cadence.sampling_params import FieldError
from cadence.server.chat_protocol import ChatMessage
from cadence.server.limits import check_request_count
from cadence.server.protocol import RequestError
from cadence.server.serving import check_unicode, render_messages

# OpenAI's own limit on the inputs of one request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body; ``truncate_prompt_tokens``, ``normalize``,
    ``add_special_tokens`` and ``priority`` are vLLM's, and so is the chat form: a
    conversation in ``messages`` (instead of ``input``) rendered with the chat template,
    with ``add_generation_prompt`` (default false), ``continue_final_message`` and
    ``chat_template_kwargs``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    # None: true for ``input``; the chat template places a conversation's special tokens.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0

    def check_form(self) -> None:
        """Exactly one of ``input`` and ``messages``, each with the fields it takes."""
        if (self.input is None) == (self.messages is None):
            raise RequestError("give exactly one of input (texts or token ids) and messages "
                               "(a conversation)", "input" if self.messages is None
                               else "messages")
        if self.messages is None:
            chat_only = [n for n in ("add_generation_prompt", "continue_final_message",
                                     "chat_template_kwargs") if n in self.model_fields_set]
            if chat_only:
                raise RequestError(f"{chat_only[0]} applies only with messages", chat_only[0])
        elif self.add_special_tokens is not None:
            raise RequestError("add_special_tokens applies only with input: the chat "
                               "template places a conversation's special tokens",
                               "add_special_tokens")
        elif not self.messages:
            raise RequestError("messages must not be empty", "messages")

    def inputs(self) -> list[str | list[int]]:
        """One string or one token-id list per input."""
        x = self.input
        if isinstance(x, str):
            x = [x]
        elif x and isinstance(x[0], int):
            x = [list(x)]
        if not x:
            raise RequestError("input must not be empty", "input")
        if len(x) > MAX_EMBEDDING_INPUTS:
            raise RequestError(f"input holds {len(x)} inputs; at most {MAX_EMBEDDING_INPUTS} "
                               "per request", "input")
        if any(not p for p in x):
            raise RequestError("input must not be empty (one of its inputs is)", "input")
        return list(x)

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(self.dimensions, self.normalize, self.truncate_prompt_tokens)
        except FieldError as e:
            raise RequestError(str(e), e.param) from None


class EmbeddingServing:
    """Serves /v1/embeddings from one ``AsyncLLM`` (or data-parallel replicas)."""

    def __init__(self, engine: Any, model_name: str, tokenizer: Any, max_model_len: int
                 ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def prompts(self, texts: list[str | list[int]], add_special_tokens: bool,
                truncate: int | None, field: str) -> list[dict]:
        """Engine prompts of ``texts`` (strings or token ids) of the body field ``field``."""
        truncate = truncation_length(truncate, self.max_model_len)
        if truncate is not None and truncate >= self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens must be < max_model_len="
                               f"{self.max_model_len}, got {truncate}",
                               "truncate_prompt_tokens")
        prompts = []
        for x in texts:
            if isinstance(x, str):
                check_unicode(x, field)
                ids = self.tokenizer.encode(x, add_special_tokens=add_special_tokens)
                kept = truncate_text_prompt(self.tokenizer, x, ids, truncate)
                prompt = {"prompt": x, "prompt_token_ids": ids}
            else:
                prompt = {"prompt": None, "prompt_token_ids": x}
                kept = truncate_prompt(x, truncate)
            if len(kept) >= self.max_model_len:
                raise RequestError(
                    f"this model's maximum context length is {self.max_model_len} tokens; an "
                    f"input has {len(kept)} (embedding inputs must be shorter; "
                    "truncate_prompt_tokens keeps an input's last tokens)", field,
                    code="context_length_exceeded")
            prompts.append({**prompt, "prompt_token_ids": kept})
        return prompts

    async def embed(self, prompts: list[dict], params: PoolingParams, priority: int,
                    field: str, lora: Any = None) -> list[EmbeddingRequestOutput]:
        """Embed every prompt, or none: a refused one aborts those already queued."""
        check_request_count(self.engine, len(prompts), field)
        base = uuid.uuid4().hex
        try:
            streams = await add_all(self.engine, [
                (prompt, params, f"embd-{base}-{i}", priority, OutputKind.FINAL_ONLY, lora)
                for i, prompt in enumerate(prompts)])
        except FieldError as e:
            name = {"prompt": field, "pooling_params": None}.get(e.param, e.param)
            raise RequestError(str(e), name) from None
        finals: list[EmbeddingRequestOutput] = await final_outputs(streams)
        for out in finals:
            if out.outputs is None:  # aborted: the client left, nobody reads this
                raise RuntimeError(out.error or "the request was aborted")
        return finals

    async def body(self, req: EmbeddingRequest, check_model: Any) -> dict:
        lora = check_model(req.model)
        req.check_form()
        params = req.pooling_params()
        if req.messages is not None:
            chat = render_messages(self.tokenizer, req.messages, req.add_generation_prompt,
                                   "use input", None, req.continue_final_message,
                                   req.chat_template_kwargs)
            field, texts, special = "messages", [chat.token_ids], False
        else:
            field, texts = "input", req.inputs()
            special = req.add_special_tokens is not False
        prompts = self.prompts(texts, special, req.truncate_prompt_tokens, field)
        finals = await self.embed(prompts, params, req.priority, field, lora)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode(out.outputs.embedding, req.encoding_format)}
                for i, out in enumerate(finals)]
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": req.model if lora else self.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def encode(vec: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a JSON list, or base64 of little-endian float32."""
    if encoding_format == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
