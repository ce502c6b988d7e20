"""From what a caller hands ``LLMEngine.add_request`` to the engine's ``Request`` objects:
every check that can refuse a request runs here, before anything is queued. No torch here."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from cadence.config import EngineConfig
from cadence.generation_defaults import default_sampling_params
from cadence.lora.registry import LoRARegistry
from cadence.pooling import PoolingParams
from cadence.pooling.intake import PoolingIntake
from cadence.request import Request
from cadence.request_intake import (
    bad_words_token_ids,
    tokenize_prompt,
    truncate_prompt,
    truncate_text_prompt,
    truncation_length,
    validate_request,
)
from cadence.sampling_params import FieldError, SamplingParams, shown


class RequestFactory:
    """Validates a request and builds its samples (``n`` > 1 makes ``n`` requests sharing
    the prompt); a ``FieldError`` (a ValueError) naming the argument or field otherwise."""

    def __init__(self, engine: Any) -> None:
        # The engine's tokenizer, vocabulary, EOS ids, backend and structured-output
        # manager are read from it at each request, never copied: they may be replaced.
        self.engine = engine
        self.config: EngineConfig = engine.config
        # Embedding requests' admission (cadence/pooling).
        self.pooling = PoolingIntake(self.config, engine.backend.name,
                                     engine.backend.supports_pooling)
        # LoRA adapters checked against the model (cadence/lora).
        self.loras = LoRARegistry(self.config.lora_config, self.config.model_config.model)

    def build(self, request_id: str, prompt: str | Sequence[int] | dict,
              params: SamplingParams | PoolingParams | None, priority: int,
              lora_request: Any, arrival: Any) -> tuple[str | None, list[int], list[Request]]:
        """(prompt text or None, prompt ids, the request's samples)."""
        engine = self.engine
        tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
        if params is None:
            params = default_sampling_params(self.config.model_config)
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = params, self.pooling.sampling_params(params)
        elif not self.config.model_config.has_lm_head:
            raise FieldError("this model is a base model saved without an LM head (an "
                             "embedding model): it serves embeddings only (LLM.embed, "
                             "/v1/embeddings), not generation", "model")
        if not isinstance(request_id, str):
            raise FieldError(f"request_id must be a string, got {type(request_id).__name__}",
                             "request_id")
        if not isinstance(params, SamplingParams):
            raise FieldError(f"params must be SamplingParams or None, got "
                             f"{type(params).__name__}", "params")
        priority = self._priority(priority)
        if lora_request is not None:
            lora_request = self.loras.check(lora_request)
        text, ids = tokenize_prompt(tokenizer, prompt)
        k = truncation_length(params.truncate_prompt_tokens,
                              self.config.scheduler_config.max_model_len)
        # The text stays the request's prompt, as in vLLM; given ids, the model's ids are cut.
        ids = truncate_prompt(ids, k) if text is None or _ids_given(prompt) \
            else truncate_text_prompt(tokenizer, text, ids, k)
        if pooling is not None:
            self.pooling.check(ids, pooling)
        params = params.for_vocabulary(vocab_size)
        validate_request(ids, params, self.config.scheduler_config, vocab_size)
        if params.structured_outputs is not None:
            engine.structured.check(params)
        if params.prompt_logprobs is not None and not engine.backend.supports_prompt_logprobs:
            raise FieldError(f"prompt_logprobs is not supported by the "
                             f"{engine.backend.name!r} backend", "prompt_logprobs")
        children = []
        for i in range(params.n):
            sp = params.for_sample(i) if params.n > 1 else params
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                prompt_token_ids=ids, sampling_params=sp, eos_token_ids=engine.eos_token_ids,
                prompt=text, parent_id=request_id, index=i, priority=priority,
                arrival_seq=next(arrival), lora_request=lora_request))
        if params.prompt_logprobs is not None:
            # One sample computes them for all: they depend on the prompt alone.
            children[0].prompt_logprobs = [None] * (len(ids) - 1)
        if pooling is not None:
            children[0].pooling = self.pooling.state(pooling, len(ids))
        if params.bad_words:
            bad = bad_words_token_ids(tokenizer, params.bad_words, vocab_size)
            for child in children:
                child.bad_words_ids = bad
        return text, ids, children

    def _priority(self, priority: object) -> int:
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise FieldError(f"priority must be an integer (lower runs first), got "
                             f"{shown(priority)}", "priority")
        policy = self.config.scheduler_config.policy
        if priority != 0 and policy != "priority":
            # vLLM refuses it too: a priority the scheduler ignores would be silently wrong.
            raise FieldError(f"priority={shown(priority)} needs the priority scheduling policy "
                             f"(--scheduling-policy priority); this engine schedules "
                             f"{policy!r}, which ignores it", "priority")
        return int(priority)


def _ids_given(prompt: Any) -> bool:
    """Whether the prompt came as token ids (a dict may carry a text beside them)."""
    return isinstance(prompt, dict) and "prompt_token_ids" in prompt
