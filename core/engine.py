"""The engine step loop: schedule -> build inputs -> backend.execute(post_sample=finalize of
the previous step) -> commit. See docs/architecture.md for the timeline.

NOTE async output processing: with it on (the default), step N's ``finalize`` runs inside
step N+1's ``execute``, while the device computes; ``step()`` therefore returns the outputs
of the previous step, and the very first ``step()`` returns nothing. The pending work is
drained synchronously when the scheduler has nothing to run, on errors, and on abort.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections.abc import Sequence
from typing import Any

from cadence.backend import Backend, ModelInput, PostSample
from cadence.config import EngineConfig
from cadence.engine_args import EngineArgs
from cadence.faults import StepGuard
from cadence.generation_defaults import default_sampling_params
from cadence.input_builder import build_model_input
from cadence.metrics import EngineStats
from cadence.output_processor import OutputProcessor
from cadence.output_state import OutputKind, ParentRequest
from cadence.outputs import RequestOutput
from cadence.plugins import get_registry
from cadence.request import Request
from cadence.sampling_params import SamplingParams, is_valid_unicode
from cadence.scheduler import RequestTooLargeError, StepPlan
from cadence.scheduling import AsyncSchedulingLoop, check_backend_supports, scheduler_class

logger = logging.getLogger(__name__)


class LLMEngine:
    """Hardware-independent engine core; the device work is delegated to a ``Backend``."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        from cadence.block_manager import BlockManager

        self.config = config
        registry = get_registry()
        backend_cls, self.backend_reason = registry.select(config.backend)
        logger.info("%s", self.backend_reason)
        if config.async_scheduling:
            check_backend_supports(backend_cls, registry)
        self.backend: Backend = backend_cls(config)
        self.backend.load_model()
        # Between load_model and allocate_kv_cache: a backend that loads in a worker process
        # returns from load_model at once, and the tokenizer loads while the worker does.
        if tokenizer is None:
            from cadence.tokenizer_loader import load_tokenizer

            tokenizer = load_tokenizer(config.model_config.tokenizer or config.model_config.model)
        self.tokenizer = tokenizer
        num_blocks = self.backend.allocate_kv_cache()
        self.backend.warmup()
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size_from_config(config.model_config.model)
        self.eos_token_ids = _eos_token_ids(tokenizer, config.model_config.model,
                                            self.vocab_size)
        cc, sc = config.cache_config, config.scheduler_config
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                          cc.sliding_window)
        self.scheduler = scheduler_class(config.async_scheduling)(
            sc, self.block_manager, settle=self._settle)
        self.stats = EngineStats()
        hook = registry.hook.cadence_post_sample if registry.has_impl(
            "cadence_post_sample") else None
        self.output_processor = OutputProcessor(
            tokenizer, self.scheduler.free_request, self.stats,
            (lambda outs: hook(outputs=outs)) if hook else None, sc.max_model_len)
        self.async_output = not config.disable_async_output_proc
        self.guard = StepGuard(
            self.backend, config.fault_config.max_worker_restarts, self._build_input,
            self.output_processor.fail, self._fail_all, self._reset_kv)
        self._pending: list[Request] = []
        self._arrival = itertools.count()
        self._registry = registry
        # The step strategy: None runs the loop below; async scheduling runs its own.
        self._async_loop = AsyncSchedulingLoop(self) if config.async_scheduling else None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, extra: dict | None = None) -> LLMEngine:
        return cls(args.create_engine_config(extra))

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | None = None, priority: int = 0,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Validate and queue a request; raises ValueError for bad input, queues nothing.
        ``params=None`` means the model's generation defaults (docs/semantics.md)."""
        if params is None:
            params = default_sampling_params(self.config.model_config)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or None, got "
                             f"{type(params).__name__}")
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
        priority = int(priority)
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            # vLLM refuses it too: a priority the scheduler ignores would be silently wrong.
            raise ValueError(f"priority={priority} needs the priority scheduling policy "
                             f"(--scheduling-policy priority); this engine schedules "
                             f"{self.config.scheduler_config.policy!r}, which ignores it")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        children = []
        for i in range(params.n):
            sp = params.for_sample(i) if params.n > 1 else params
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                prompt_token_ids=ids, sampling_params=sp, eos_token_ids=self.eos_token_ids,
                prompt=text, parent_id=request_id, index=i, priority=priority,
                arrival_seq=next(self._arrival)))
        clash = [c.request_id for c in children if self.scheduler.get_request(c.request_id)]
        if clash:
            # Checked before anything is added: a half-added request would never finish.
            raise ValueError(f"request_id {request_id!r}: the id {clash[0]!r} of one of its "
                             "samples is in use by another request (the samples of n > 1 "
                             "are named '<index>_<request_id>')")
        self.output_processor.add(ParentRequest(request_id, text, ids, children, output_kind))
        for child in children:
            self.scheduler.add_request(child)
        self.stats.num_requests_added += 1
        self.stats.num_prompt_tokens += len(ids)

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id, for callers that want a single one; every id in
        ``eos_token_ids`` stops generation."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _tokenize(self, prompt: str | Sequence[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            # A misspelt key ("prompt_token_id") must not leave the other one used silently.
            unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
            if unknown:
                raise ValueError(f"a prompt dict takes the keys 'prompt' and "
                                 f"'prompt_token_ids', got {unknown}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, _token_list(prompt["prompt_token_ids"])
            if text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if not is_valid_unicode(prompt):
                raise ValueError("prompt must be valid Unicode text (it has a lone surrogate)")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise ValueError("prompt must be a string, a list of token ids or a dict with "
                             f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        return None, _token_list(prompt)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        sc = self.config.scheduler_config
        max_len = sc.max_model_len
        if params.n > sc.max_num_samples:
            raise ValueError(f"n must be <= max_num_samples ({sc.max_num_samples}), got "
                             f"{params.n}")
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={max_len} to leave room for output")
        # The server's words for the same mistake (serving.py), so clients that look for
        # "maximum context length" find it either way. None means the rest of the context.
        room = max_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is max_model_len={max_len} tokens; "
                f"{len(ids)} in the prompt + max_tokens={params.max_tokens} is "
                f"{len(ids) + params.max_tokens}; lower max_tokens to {room} or less, or "
                "pass None for the rest of the context")
        if params.min_tokens > room:
            raise ValueError(f"min_tokens must be <= {room} (max_model_len={max_len} less "
                             f"the prompt's {len(ids)} tokens), got {params.min_tokens}")
        vocab = self.vocab_size
        if vocab and any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        params.check_against_model(vocab)
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")


    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples); its final output has finish_reason 'abort'."""
        self.output_processor.abort(
            request_id, lambda r: self.scheduler.abort_request(r.request_id))

    def has_unfinished_requests(self) -> bool:
        return (bool(self.output_processor.parents) or bool(self._pending)
                or bool(self.output_processor.ready)
                or (self._async_loop is not None and self._async_loop.has_in_flight))

    # ---- the step ---------------------------------------------------------------------
    def _settle(self, req: Request) -> None:
        self.output_processor.settle(req)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.output_processor.finalize(pending)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs that became ready during it."""
        if self._async_loop is not None:
            return self._async_loop.step()
        self.guard.repair()
        times = self.stats.times
        t0 = time.perf_counter()
        try:
            plan = self.scheduler.schedule()
        except RequestTooLargeError as e:
            # Only that request can never run; the next step schedules the others.
            self.output_processor.fail(e.request.parent_id, str(e))
            return self._finish_step()
        t1 = time.perf_counter()
        times.add("schedule", t1 - t0)
        if plan.is_empty:
            self._drain()
            times.add("drain", time.perf_counter() - t1)
            return self._finish_step()
        mi = self._build_input(plan)
        t2 = time.perf_counter()
        times.add("prepare", t2 - t1)
        pending, self._pending = self._pending, []
        post_time = [0.0]

        def finalize_previous() -> None:
            ts = time.perf_counter()
            if pending:
                self.output_processor.finalize(pending)
            post_time[0] = time.perf_counter() - ts

        post_sample = PostSample(finalize_previous if self.async_output else None)
        ran = self.guard.run(plan, mi, post_sample)
        t3 = time.perf_counter()
        times.add("execute", t3 - t2)
        times.add("post_sample", post_time[0])
        touched = []
        for r in ran:
            touched += self.output_processor.commit(r.plan.scheduled,
                                                    r.model_input.sample_seq_indices, r.output)
            self.scheduler.update_after_step(r.plan)
        self._stamp_token_times(touched)
        self._pending = touched
        if not self.async_output:
            self._drain()
        t4 = time.perf_counter()
        times.add("commit", t4 - t3)
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += plan.num_batched_tokens
        return self._finish_step()

    def _stamp_token_times(self, touched: list[Request]) -> None:
        now = time.monotonic()
        itl = self.stats.inter_token_latency
        for req in touched:
            # Inter-token latency at commit, when each token's time is known: finalize runs
            # a step later and in batches, so its clock would not see the gaps. Kept to a
            # subtraction and a bisect per token, the hot path's budget.
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                itl.observe(now - req.last_token_time)
            req.last_token_time = now

    def _build_input(self, plan: StepPlan) -> ModelInput:
        return build_model_input(plan, self.block_manager.get_block_table,
                                 self.config.cache_config.block_size)

    def _fail_all(self, message: str) -> None:
        if self._async_loop is not None:
            self._async_loop.discard()  # the device state those steps ran on is gone
        self._drain()
        self.output_processor.fail_all(message)

    def _reset_kv(self, num_blocks: int) -> None:
        # The restarted backend's cache holds nothing: every block, cached prefixes included,
        # starts free. Every request was failed first, so none still holds one.
        cc = self.config.cache_config
        self.block_manager.reset(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache reset: %d blocks of %d tokens", num_blocks, cc.block_size)

    def check_health(self) -> list[RequestOutput]:
        """Between steps: ask the backend whether its worker lives. If it was lost, every
        request ends with an error (their final outputs are returned) and a restart is
        planned for ``repair()`` or the next ``step()``; raises ``EngineFailedError`` when
        it may not be restarted."""
        self.guard.check_health()
        return self.output_processor.take_ready()

    def repair(self) -> None:
        """Restart a lost backend now, if one is waiting for it (``step`` does it too)."""
        self.guard.repair()

    def _finish_step(self) -> list[RequestOutput]:
        self.stats.times.num_steps += 1
        self.stats.num_running = self.scheduler.num_running
        self.stats.num_waiting = self.scheduler.num_waiting
        self.stats.kv_cache_usage = self.block_manager.usage
        return self.output_processor.take_ready()

    def shutdown(self) -> None:
        self._drain()
        self.backend.shutdown()
        self._registry.hook.cadence_shutdown()


def vocab_size_from_config(model_dir: str) -> int | None:
    """``vocab_size`` from the model folder's config.json (or its text_config)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def _eos_token_ids(tokenizer: Any, model_dir: str, vocab_size: int | None
                   ) -> tuple[int, ...]:
    """Every EOS id generation_config.json lists (what generate() stops on; Llama 3 Instruct
    lists three), else the tokenizer's. Ids outside the vocabulary are dropped: the model
    can never sample them, and the sampler could not ban them below min_tokens."""
    import json
    import os

    ids: list = []
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not ids:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eos is None else [eos]
    return tuple(t for t in dict.fromkeys(int(t) for t in ids)
                 if vocab_size is None or 0 <= t < vocab_size)


def _token_list(ids: object) -> list[int]:
    """A prompt's token ids as a list of plain ints (numpy integers accepted); bytes,
    non-sequences, floats and bools are refused (ValueError)."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
        raise ValueError("prompt_token_ids must be a list of integers, got "
                         f"{type(ids).__name__}")
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"prompt_token_ids must be integers, got {t!r} "
                             f"({type(t).__name__})")
    return [int(t) for t in ids]
