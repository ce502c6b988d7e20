"""The OpenAI endpoints' logic, apart from HTTP: tokenize, check limits, submit, and build
the response bodies (the server-sent-event chunks: streams.py)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from cadence.async_engine import AsyncLLM, RequestStream
from cadence.async_stream import add_all, final_outputs
from cadence.chat import ChatPrompt, has_chat_template, render_chat
from cadence.detokenizer import token_bytes_decoder
from cadence.lora import LoRARequest
from cadence.output_state import OutputKind
from cadence.request_intake import truncate_prompt, truncate_text_prompt, truncation_length
from cadence.sampling_params import FieldError, SamplingParams, is_valid_unicode
from cadence.server import formats, reasoning, tools
from cadence.server.chat_protocol import ChatCompletionRequest, ChatMessage
from cadence.server.chat_reply import ChatReply
from cadence.server.limits import ServerLimits, check_request_count
from cadence.server.protocol import CompletionRequest, RequestError
from cadence.server.streams import StreamedReplies


class OpenAIServing(StreamedReplies):
    """Serves /v1/completions and /v1/chat/completions from one ``AsyncLLM`` (its streams:
    streams.py)."""

    def __init__(self, engine: AsyncLLM, model_name: str, max_logprobs: int = 20,
                 limits: ServerLimits | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None,
                 lora_modules: Sequence[LoRARequest] = ()) -> None:
        self.engine = engine
        # The LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): a
        # body's ``model`` picks one.
        self.loras: dict[str, LoRARequest] = {lr.lora_name: lr for lr in lora_modules}
        if model_name in self.loras:
            raise ValueError(f"a LoRA adapter may not take the served model's name "
                             f"{model_name!r}; rename it in --lora-modules")
        # Splits a reasoning model's thinking from its answer (reasoning_content).
        self.reasoning_parser = None if reasoning_parser is None else \
            reasoning.REASONING_PARSERS[reasoning_parser]()
        # tool_choice "auto" reads calls out of the text with it; None: "auto" is refused.
        self.tool_parser = None if tool_parser is None else tools.TOOL_PARSERS[tool_parser]()
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        self.limits = limits or ServerLimits()
        self.tokenizer = engine.tokenizer
        # A logprob entry's bytes: the token's own, also for part of a UTF-8 character.
        self.token_bytes = token_bytes_decoder(self.tokenizer)
        self.max_model_len = engine.max_model_len
        # The model's vocabulary (config.json), which may be wider than the tokenizer's.
        self.vocab_size = getattr(getattr(engine, "engine", None), "vocab_size", None)
        self.generation_defaults = dict(engine.generation_defaults)

    # ---- request preparation ----------------------------------------------------------
    def check_model(self, requested: str | None) -> LoRARequest | None:
        """The adapter a body's ``model`` names, None for the base model; 404 if unknown."""
        if requested is None or requested == self.model_name:
            return None
        lora = self.loras.get(requested)
        if lora is None:
            served = ", ".join(repr(n) for n in [self.model_name, *self.loras])
            raise RequestError(f"the model {requested!r} does not exist; this server serves "
                               f"{served}", "model", 404, "model_not_found")
        return lora

    def response_model(self, req: Any) -> str:
        """The ``model`` a response names: the one the body asked for (checked when it was
        queued: an adapter unloaded since still answers under its name), else the served
        model."""
        return req.model or self.model_name

    def _make_params(self, req: CompletionRequest | ChatCompletionRequest
                     ) -> Callable[[int], SamplingParams]:
        """``max_tokens -> SamplingParams`` for ``req``, with the model's generation defaults
        for the sampling fields the body leaves out or sends as null (vLLM's rule)."""
        return lambda max_tokens: req.sampling_params(max_tokens, self.generation_defaults)

    def _params(self, num_prompt: int, requested: int | None, make: Any, prompt_field: str,
                min_tokens: int = 0) -> SamplingParams:
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {num_prompt}", prompt_field, code="context_length_exceeded")
        # More than the context holds is cut to what it does, as vLLM's server does: clients
        # send one max_tokens to models of every context length.
        cut = min(requested, room) if requested is not None \
            else self.limits.max_tokens_for(room)
        # Never below min_tokens where the body allows that many: a min_tokens past the
        # context is then refused for the context, not for a max_tokens the body never sent.
        floor = min_tokens if requested is None else min(min_tokens, requested)
        return make(max(cut, floor))

    def completion_inputs(self, req: CompletionRequest) -> list[tuple[dict, SamplingParams]]:
        self.check_model(req.model)
        self.limits.check(req)
        req.check(self.max_logprobs)
        return [(prompt, self._params(len(prompt["prompt_token_ids"]), req.max_tokens,
                                      self._make_params(req), "prompt", req.min_tokens))
                for prompt in self.completion_prompts(req)]

    def completion_prompts(self, req: CompletionRequest) -> list[dict]:
        """Each prompt of the body as an engine prompt (text and ids), truncated as asked."""
        prompts = []
        k = truncation_length(req.truncate_prompt_tokens, self.max_model_len)
        for p in req.prompts():
            if isinstance(p, str):
                if not p:
                    raise RequestError("prompt must not be empty", "prompt")
                check_unicode(p, "prompt")
                special = req.add_special_tokens is not False
                ids = truncate_text_prompt(self.tokenizer, p, self.tokenizer.encode(
                    p, add_special_tokens=special), k)
                prompts.append({"prompt": p, "prompt_token_ids": ids})
            else:
                prompts.append({"prompt": None, "prompt_token_ids": truncate_prompt(
                    list(p), k)})
        return prompts

    def chat_top_logprobs(self, req: ChatCompletionRequest) -> int | None:
        """How many alternatives each chat logprobs entry lists; None without logprobs."""
        if not req.logprobs:
            return None
        k = req.top_logprobs or 0
        return (self.vocab_size or len(self.tokenizer)) if k == -1 else k

    def chat_input(self, req: ChatCompletionRequest) -> tuple[dict, SamplingParams]:
        self.check_model(req.model)
        self.limits.check(req)
        req.check(self.max_logprobs)
        prompt = self.chat_prompt(req)
        params = self._params(len(prompt["prompt_token_ids"]), req.requested_max_tokens,
                              self._make_params(req), "messages", req.min_tokens)
        if req.effective_tool_choice == "auto" and self.tool_parser.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return prompt, params

    def chat_prompt(self, req: ChatCompletionRequest) -> dict:
        """The conversation rendered with the chat template, as an engine prompt."""
        choice = req.effective_tool_choice
        if choice == "auto" and self.tool_parser is None:
            raise RequestError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser "
                f"({', '.join(sorted(tools.TOOL_PARSERS))}); or name a function, or use "
                '"required" or "none"', "tool_choice")
        chat = render_messages(self.tokenizer, req.messages, req.add_generation_prompt,
                               "use /v1/completions",
                               [t.as_template_dict() for t in req.tools or ()],
                               req.continue_final_message, _template_kwargs(req),
                               req.documents, bool(req.add_special_tokens))
        prompt = chat.as_engine_prompt()
        kept = truncate_prompt(chat.token_ids,
                               truncation_length(req.truncate_prompt_tokens, self.max_model_len))
        if len(kept) < len(chat.token_ids):
            prompt = {"prompt": None, "prompt_token_ids": kept}
        return prompt

    def _reply(self, req: ChatCompletionRequest) -> ChatReply:
        # A JSON or choice constraint (a response format, a named or required tool) holds
        # from the reply's first token, so the reply has no thinking to split off: read as
        # thinking, a forced call that never closes </think> would be lost. A regex or a
        # grammar may spell out the thinking itself; the parser still reads those.
        constraint = req._structured()
        thinking = self.reasoning_parser if constraint is None or \
            constraint.regex is not None or constraint.grammar is not None else None
        return ChatReply(req.effective_tool_choice, self.tool_parser, thinking,
                         req.parallel_tool_calls)

    async def submit(self, inputs: list[tuple[dict, SamplingParams]],
                     req: CompletionRequest | ChatCompletionRequest, kind: OutputKind
                     ) -> list[RequestStream]:
        """Queue every prompt at once, or none: one prompt's error aborts the others."""
        check_request_count(self.engine, len(inputs), "prompt")
        # The body's request_id names the response; the engine's ids stay unique, so a
        # client that sends one id twice (a retry) is not refused for it.
        base = uuid.uuid4().hex if req.request_id is None else \
            f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        try:
            lora = self.check_model(req.model)
            streams = await add_all(self.engine, [
                (prompt, params, f"{base}-{i}", req.priority, kind, lora)
                for i, (prompt, params) in enumerate(inputs)])
        except BaseException as e:
            # The engine parses the grammar and names it structured_outputs.<kind>; the
            # client may have sent it as guided_* or response_format.
            if isinstance(e, ValueError) and str(e).startswith("structured_outputs."):
                field = req.structured_field
                message = str(e) if field == "structured_outputs" else f"{field}: {e}"
                raise RequestError(message, field) from None
            if isinstance(e, FieldError):  # the engine's checks: n, top_k, token ids...
                raise RequestError(str(e), req.body_field(e.param)) from None
            raise
        return streams

    # ---- whole responses ---------------------------------------------------------------
    async def completion_body(self, streams: list[RequestStream], req: CompletionRequest
                              ) -> dict:
        finals = await final_outputs(streams)
        choices, usage = [], formats.Usage()
        for i, out in enumerate(finals):
            if req.echo_only:
                out = formats.without_samples(out)
            usage.add(out)
            echo = formats.echo_prefix(out, req.echo, req.logprobs, self.tokenizer)
            for c in out.outputs:
                choice, _ = formats.completion_choice_of(i * req.n + c.index, c,
                                                         req.logprobs, echo, 0)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = formats.prompt_logprobs_json(
                        out.prompt_logprobs)
                choices.append(choice)
        return formats.envelope("cmpl", "text_completion", self.response_model(req), choices,
                                usage.as_dict(), req.request_id)

    async def chat_body(self, streams: list[RequestStream], req: ChatCompletionRequest
                        ) -> dict:
        (out,) = await final_outputs(streams)
        usage = formats.Usage()
        usage.add(out)
        choices = [formats.chat_choice(c, self.chat_top_logprobs(req), self.token_bytes)
                   for c in out.outputs]
        reply = self._reply(req)
        echo = req.echo_text
        for choice, c in zip(choices, out.outputs):
            fields, choice["finish_reason"] = reply.whole(c.text, c.finish_reason)
            choice["message"].update(fields)
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            if echo:
                choice["message"]["content"] = echo + (choice["message"]["content"] or "")
        body = formats.envelope("chatcmpl", "chat.completion", self.response_model(req),
                                choices, usage.as_dict(), req.request_id)
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = formats.prompt_logprobs_json(out.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body


def render_messages(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                    instead: str, tool_defs: list[dict] | None = None,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    documents: list[dict[str, Any]] | None = None,
                    add_special_tokens: bool = False) -> ChatPrompt:
    """The chat template's rendering of ``messages``, or a 400 naming ``messages`` (with
    ``instead`` saying what to do when the model has no template)."""
    if not has_chat_template(tokenizer):
        raise RequestError(f"this model has no chat template; {instead}", "messages")
    try:
        return render_chat(tokenizer, [m.as_template_dict() for m in messages],
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           chat_template_kwargs=template_kwargs, tools=tool_defs,
                           documents=documents, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise RequestError(str(e), "messages") from None


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's extra variables: the body's own, and OpenAI's ``reasoning_effort``
    where the body sets it (templates that know it read it, as vLLM hands it over)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def check_unicode(text: str, param: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"); the tokenizer cannot take them."""
    if not is_valid_unicode(text):
        raise RequestError(f"{param} must be valid Unicode text (it has a lone surrogate)",
                           param)
