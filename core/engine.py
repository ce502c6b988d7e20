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
import time
from collections.abc import Sequence
from typing import Any

from cadence.backend import Backend, ModelInput, PostSample
from cadence.config import EngineConfig
from cadence.engine_args import EngineArgs
from cadence.engine_health import EngineHealth
from cadence.executor import create_executor
from cadence.faults import StepGuard
from cadence.input_builder import build_model_input
from cadence.lora import LoRARequest
from cadence.lora.admission import adapter_names
from cadence.metrics import EngineStats
from cadence.output_processor import OutputProcessor
from cadence.output_state import OutputKind, ParentRequest
from cadence.outputs import RequestOutput
from cadence.plugins import get_registry
from cadence.pooling import PoolingParams
from cadence.request import Request
from cadence.request_factory import RequestFactory
from cadence.request_intake import eos_token_ids, vocab_size_from_config
from cadence.sampling_params import FieldError, SamplingParams, resolve_output_kind
from cadence.scheduling import check_backend_runs, make_scheduler, make_step_loop
from cadence.step_plan import RequestTooLargeError, StepPlan
from cadence.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine(EngineHealth):
    """Hardware-independent engine core; the device work is delegated to a ``Backend``."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config
        registry = get_registry()
        backend_cls, self.backend_reason = registry.select(config.backend)
        logger.info("%s", self.backend_reason)
        check_backend_runs(backend_cls, registry, config)
        # The backend itself (uniproc), or an executor running its ranks (core/executor/).
        self.backend: Backend = create_executor(backend_cls, config)
        try:
            self._start(config, tokenizer, registry)
        except BaseException:
            # A start that fails past this point (a bad tokenizer, a KV cache too small) must
            # not leave a worker process or rank loading a model for nobody: stopped now, not
            # whenever the collector gets to it.
            try:
                self.backend.shutdown()
            except Exception:  # the start's own error is the one to report
                logger.debug("shutdown after a failed start raised", exc_info=True)
            raise

    def _start(self, config: EngineConfig, tokenizer: Any, registry: Any) -> None:
        from cadence.block_manager import BlockManager

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
        self.eos_token_ids = eos_token_ids(tokenizer, config.model_config.eos_token_ids,
                                           self.vocab_size)
        cc, sc = config.cache_config, config.scheduler_config
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                          cc.sliding_window)
        self.scheduler = make_scheduler(config, self.block_manager, self._settle)
        self.stats = EngineStats(speculative=config.speculative_config is not None)
        # Structured output; compiles nothing and imports no xgrammar until a request asks.
        self.structured = StructuredOutputManager(
            tokenizer, self.vocab_size or len(tokenizer), list(self.eos_token_ids))
        self.requests = RequestFactory(self)
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
        # The step strategy: None runs the loop below; async scheduling and pipeline
        # parallel run their own (core/scheduling/).
        self._loop = make_step_loop(self)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, extra: dict | None = None) -> LLMEngine:
        return cls(args.create_engine_config(extra))

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    output_kind: OutputKind | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises ValueError for bad input (a ``FieldError``
        naming the argument or ``SamplingParams`` field in ``param``), queues nothing.
        ``params=None`` means the model's generation defaults (docs/semantics.md);
        ``PoolingParams`` make it an embedding request, whose one output is an
        ``EmbeddingRequestOutput`` (cadence/pooling). ``lora_request`` runs it with a LoRA
        adapter (cadence/lora; the engine must serve adapters: ``enable_lora``).
        ``output_kind`` None: the params' ``output_kind``, else ``CUMULATIVE``."""
        output_kind = resolve_output_kind(output_kind, params, OutputKind.CUMULATIVE)
        if isinstance(request_id, str) and request_id in self.output_processor.parents:
            raise FieldError(f"request_id {request_id!r} is already in use", "request_id")
        text, ids, children = self.requests.build(request_id, prompt, params, priority,
                                                  lora_request, self._arrival)
        # Scheduled, waiting for its grammar, or a finished sample of a live request
        # whose output is still to come: a sample holds the id until its parent ends.
        clash = [c.request_id for c in children if self.scheduler.get_request(c.request_id)
                 or self.structured.holds(c.request_id)
                 or self.output_processor.holds_sample(c.request_id)]
        if clash:
            # Checked before anything is added: a half-added request would never finish.
            raise FieldError(f"request_id {request_id!r}: the id {clash[0]!r} of one of its "
                             "samples is in use by another request (the samples of n > 1 "
                             "are named '<index>_<request_id>')", "request_id")
        self.output_processor.add(ParentRequest(request_id, text, ids, children, output_kind))
        if children[0].sampling_params.structured_outputs is not None:
            self.structured.hold(children)  # to the scheduler once its grammar compiled
        else:
            for child in children:
                self.scheduler.add_request(child)
        self.stats.num_requests_added += 1
        self.stats.num_prompt_tokens += len(ids)

    # ---- LoRA adapters (vLLM's names) ---------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model ahead of its requests; ValueError if bad."""
        return self.requests.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already queued with it finish with it)."""
        return self.requests.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.requests.loras.list()

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id, for callers that want a single one; every id in
        ``eos_token_ids`` stops generation."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples); its final output has finish_reason 'abort'."""
        self.output_processor.abort(
            request_id, lambda r: self.scheduler.abort_request(r.request_id))

    def has_unfinished_requests(self) -> bool:
        return (bool(self.output_processor.parents) or bool(self._pending)
                or bool(self.output_processor.ready)
                or (self._loop is not None and self._loop.has_in_flight))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), so later prompts are
        computed from scratch: for benchmarks, or after the weights changed. Only while the
        engine is idle, since a running request's table names cached blocks; returns False
        and changes nothing otherwise."""
        if self.has_unfinished_requests():
            return False
        self.block_manager.reset(self.num_blocks)
        return True

    # ---- the step ---------------------------------------------------------------------
    def _settle(self, req: Request) -> None:
        self.output_processor.settle(req)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.output_processor.finalize(pending)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs that became ready during it."""
        if self._loop is not None:
            return self._loop.step()
        self.guard.repair()
        times = self.stats.times
        plan = self.plan()
        if plan is None:
            return self._finish_step()
        t1 = time.perf_counter()
        if plan.is_empty:
            self._drain()
            times.add("drain", time.perf_counter() - t1)
            return self._finish_step()
        mi = self._build_input(plan)
        t2 = time.perf_counter()
        times.add("prepare", t2 - t1)
        # Empty with async output processing off: each step drained its own.
        pending, self._pending = self._pending, []
        post_time = [0.0]
        grammar = mi.sampling.grammar

        def post() -> None:
            if grammar is not None:
                grammar.get()  # first: the device waits for it before sampling
            ts = time.perf_counter()
            if pending:
                self.output_processor.finalize(pending)
            post_time[0] = time.perf_counter() - ts

        post_sample = PostSample(post if self.async_output or grammar is not None else None)
        ran = self.guard.run(plan, mi, post_sample)
        t3 = time.perf_counter()
        times.add("execute", t3 - t2)
        times.add("post_sample", post_time[0])
        if grammar is not None:
            times.add("bitmask", grammar.seconds)
        touched = []
        for r in ran:
            touched += self.output_processor.commit(r.plan.scheduled,
                                                    r.model_input.sample_seq_indices, r.output,
                                                    r.model_input)
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

    def plan(self) -> StepPlan | None:
        """The scheduler's plan for the next step, timed (both step loops start here); None
        when a request that can never run was failed instead (the next step plans the
        others)."""
        t0 = time.perf_counter()
        if self.structured.num_waiting:
            # Requests whose grammar compiled join the scheduler; wait for one only when
            # nothing else could run meanwhile.
            self.structured.admit(self.scheduler.add_request, self.output_processor.fail,
                                  block=not self.scheduler.has_unfinished_requests())
        try:
            plan = self.scheduler.schedule()
        except RequestTooLargeError as e:
            self.output_processor.fail(e.request.parent_id, str(e))
            return None
        self.stats.times.add("schedule", time.perf_counter() - t0)
        return plan

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
        mi = build_model_input(plan, self.block_manager.get_block_table,
                               self.config.cache_config.block_size)
        mi.sampling.grammar = self.structured.bitmask_for(
            [plan.scheduled[i].request for i in mi.sample_seq_indices])
        return mi

    def _finish_step(self) -> list[RequestOutput]:
        self.stats.times.num_steps += 1
        self.stats.num_running = self.scheduler.num_running
        self.stats.num_waiting = self.scheduler.num_waiting
        self.stats.kv_cache_usage = self.block_manager.usage
        if self.config.lora_config is not None:
            # vLLM's lora_requests_info; only with adapters (the waiting scan is O(queue)).
            self.stats.max_loras = self.config.lora_config.max_loras
            self.stats.running_loras = adapter_names(self.scheduler.running)
            self.stats.waiting_loras = adapter_names(self.scheduler.waiting.requests())
        return self.output_processor.take_ready()

    def shutdown(self) -> None:
        if self._loop is not None:
            # Nothing stays submitted past the backend: the steps async scheduling or the
            # pipeline planned ahead are collected (their tokens are committed, or dropped
            # for requests that ended meanwhile).
            try:
                self._loop.flush()
            except Exception:
                logger.exception("collecting the steps in flight at shutdown failed")
        self._drain()
        self.structured.shutdown()
        self.backend.shutdown()
        self._registry.hook.cadence_shutdown()
