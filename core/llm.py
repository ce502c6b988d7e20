"""The offline Python API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from cadence.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    detokenizer,
    search,
    step_params,
)
from cadence.chat import render_chat, split_conversations
from cadence.engine import LLMEngine
from cadence.engine_args import EngineArgs
from cadence.generation_defaults import default_sampling_params, describe_generation_defaults
from cadence.llm_inputs import per_lora, per_prompt, prompt_list, with_tokenization
from cadence.lora import LoRARequest
from cadence.output_state import OutputKind
from cadence.outputs import (
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from cadence.pooling import PoolingParams
from cadence.pooling.scoring import cosine, score_pairs
from cadence.request_intake import tokenize_prompt
from cadence.sampling_params import FieldError, SamplingParams

PromptType = str | dict | Sequence[int]
logger = logging.getLogger(__name__)


class LLM:
    """Offline batched generation, named like vLLM's ``LLM``.

    ``LLM(model=PATH, backend="cpu", dtype="auto", seed=0, max_model_len=None,
    disable_async_output_proc=False, **engine_args)``; without ``model`` the built-in
    SmolLM2-135M-Instruct is used. Any other ``EngineArgs`` field may be passed by name;
    ``backend_options`` carries backend-specific knobs.
    """

    def __init__(self, model: str | None = None, backend: str = "cpu",
                 max_logprobs: int | None = None, **kwargs: Any) -> None:
        valid = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid: "
                             f"{sorted(valid | {'max_logprobs'})}")
        if max_logprobs is not None and (not isinstance(max_logprobs, int)
                                         or isinstance(max_logprobs, bool)
                                         or max_logprobs < -1):
            raise FieldError(f"max_logprobs must be None (no limit but the vocabulary), -1 "
                             f"(the whole vocabulary) or an integer >= 0, got "
                             f"{max_logprobs!r}", "max_logprobs")
        # vLLM's limit on logprobs / prompt_logprobs (its default is 20; cadence's None
        # leaves only the vocabulary's).
        self.max_logprobs = max_logprobs
        args = EngineArgs(model=model, backend=backend, **kwargs)
        self.engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()
        note = describe_generation_defaults(
            self.engine.config.model_config.generation_defaults, "generation_config='none'")
        if note:
            # A warning, as in vLLM: the model, not the caller, changed how it samples.
            logger.warning("%s", note)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams ``generate`` and ``chat`` use when given none: cadence's
        defaults overlaid with the model's generation_config.json (vLLM's rule). Explicit
        SamplingParams are used as they are; to start from the model's defaults, pass
        ``dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)``."""
        return default_sampling_params(self.engine.config.model_config)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        ``prompts``: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
        ``sampling_params``: one for all prompts, or one per prompt; None means
        ``get_default_sampling_params()`` (the model's generation_config.json defaults).
        ``lora_request``: a LoRA adapter for all prompts, or one (or None) per prompt; the
        engine must serve adapters (``enable_lora=True``; docs/semantics.md).
        Invalid input raises ValueError before anything is queued. A request the engine
        failed on (docs/reliability.md) comes back with ``finish_reason="error"`` and the
        reason in ``RequestOutput.error``; the others are unaffected.
        ``tokenization_kwargs`` (vLLM's): ``{"truncate_prompt_tokens": k}`` cuts every prompt
        to its last ``k`` tokens (-1: as many as the context holds).
        """
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = per_prompt(sampling_params, SamplingParams, "sampling_params", len(prompts))
        params = with_tokenization(params, tokenization_kwargs)
        for sp in params:
            self._check_logprobs(sp)
        if priority is not None and (not isinstance(priority, (list, tuple))
                                     or len(priority) != len(prompts)):
            raise FieldError(f"priority must be None or a list of integers with one entry "
                             f"per prompt ({len(prompts)}), got {priority!r:.60}", "priority")
        return self._run_all(prompts, params, priority, use_tqdm,
                             per_lora(lora_request, len(prompts)))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``); results come back in prompt order,
        each vector in ``output.outputs.embedding``.

        The model pools its final hidden states as ``PoolerConfig`` says (last token by
        default; the model folder's sentence-transformers files or ``pooling_type=`` and
        ``pooling_normalize=`` at construction change it: docs/semantics.md,
        "Embeddings"). ``pooling_params``: one for all prompts, or one per prompt.
        ``truncate_prompt_tokens=k`` embeds each prompt's last ``k`` tokens. A request the
        engine failed on comes back with ``outputs=None`` and the reason in ``error``.
        """
        prompts = prompt_list(prompts)
        params = per_prompt(pooling_params or PoolingParams(), PoolingParams,
                             "pooling_params", len(prompts))
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                      for p in params]
        return self._run_all(prompts, params, None, use_tqdm,
                             per_lora(lora_request, len(prompts)))

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams, lora_request: LoRARequest | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``); one
        ``BeamSearchOutput`` per prompt, its ``sequences`` best first (core/beam_search.py;
        docs/semantics.md, "Beam search"). Each round runs every live beam as a one-token
        request through the engine, all prompts' beams in one batch; ``lora_request``
        runs them all with that adapter."""
        if not isinstance(params, BeamSearchParams):
            raise FieldError(f"params must be BeamSearchParams, got {type(params).__name__}",
                             "params")
        engine = self.engine
        searches = [BeamSearch(tokenize_prompt(engine.tokenizer, p)[1], params,
                               engine.eos_token_ids,
                               engine.config.scheduler_config.max_model_len)
                    for p in prompt_list(prompts)]
        step = step_params(params)

        def run_round(ids: list[list[int]]) -> list[RequestOutput]:
            return self._run_all([{"prompt_token_ids": p} for p in ids], [step] * len(ids),
                                 None, False, per_lora(lora_request, len(ids)))

        search(searches, run_round)
        decode = detokenizer(engine.tokenizer)
        return [s.output(decode) for s in searches]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs (vLLM's ``LLM.score`` with an embedding model):
        the cosine similarity of their embeddings, for ``data_1`` against each of
        ``data_2`` (one and N), or pair by pair (N and N)."""
        one, two = prompt_list(data_1), prompt_list(data_2)
        try:
            pairs = score_pairs(len(one), len(two))
        except FieldError as e:  # named for the server's body; here they are data_1/2
            raise FieldError(str(e).replace("text_", "data_"),
                             e.param.replace("text_", "data_")) from None
        vecs = [o.outputs.embedding if o.outputs is not None else None for o in self.embed(
            one + two, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens),
            use_tqdm, lora_request=lora_request)]
        out = []
        for k, (i, j) in enumerate(pairs):
            a, b = vecs[i], vecs[len(one) + j]
            if a is None or b is None:
                raise RuntimeError("score: the engine failed to embed one of the texts")
            out.append(ScoringRequestOutput(str(k), ScoringOutput(cosine(a, b))))
        return out

    def _check_logprobs(self, sp: SamplingParams) -> None:
        limit = self.max_logprobs
        if limit is None:
            return
        vocab = self.engine.vocab_size or len(self.engine.tokenizer)
        most = vocab if limit == -1 else limit
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sp, name)
            if asked is not None and (vocab if asked == -1 else asked) > most:
                raise FieldError(f"{name}={asked} asks for more tokens than this LLM's "
                                 f"max_logprobs={limit} allows (LLM(max_logprobs=-1) gives "
                                 "the whole vocabulary)", name)

    def _run_all(self, prompts: list, params: list, priority: Sequence[int] | None,
                 use_tqdm: bool, loras: list | None = None) -> list:
        ids = [str(next(self._counter)) for _ in prompts]
        added = []
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, params)):
                self.engine.add_request(rid, prompt, sp,
                                        priority=priority[i] if priority else 0,
                                        output_kind=OutputKind.FINAL_ONLY,
                                        lora_request=loras[i] if loras else None)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            self._run_until_done(None)
            raise
        except BaseException as e:  # another failure, or Ctrl-C, between two requests
            # The request being added may be half in: aborting it too is harmless.
            for rid in ids[:len(added) + 1]:
                self.engine.abort_request(rid)
            if not isinstance(e, Exception):
                with contextlib.suppress(Exception):
                    self.engine.after_interrupt()
            raise
        return self._run_until_done(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: Sequence[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or
        to a list of conversations; results come back in conversation order (vLLM's
        ``LLM.chat``).

        Each conversation is rendered with the tokenizer's chat template (or
        ``chat_template``) and tokenized without adding special tokens again, so the prompt
        ids equal transformers' ``apply_chat_template(..., tokenize=True)`` (core/chat.py).
        ``sampling_params`` works as in ``generate``. ``tools`` (OpenAI's function
        definitions) reach the template as transformers passes them; reading calls out of
        the reply is the caller's (the server's parsers: docs/server.md, "Tool calling").
        """
        tokenizer = self.get_tokenizer()
        prompts = [render_chat(tokenizer, conversation, chat_template, add_generation_prompt,
                               continue_final_message, chat_template_kwargs,
                               tools).as_engine_prompt()
                   for conversation in split_conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run_until_done(self, ids: list[str] | None, use_tqdm: bool = False
                        ) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and ids:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except Exception:
            raise
        except BaseException:
            # Ctrl-C: this call's requests end here, not in whichever call comes next.
            for rid in ids or ():
                if rid not in done:
                    self.engine.abort_request(rid)
            with contextlib.suppress(Exception):  # a failure here is the next call's to meet
                self.engine.after_interrupt()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids] if ids else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing changed) while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
