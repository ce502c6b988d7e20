"""Pipeline parallel's step loop: one micro-batch in flight per stage. No torch here.

With the layers split over S stages (docs/distributed.md), one batch at a time would leave
S - 1 stages idle. So the engine keeps up to S micro-batches in flight, each of other
requests: a request waiting for a token is in at most one, and is scheduled again only once
its micro-batch is committed, so nothing is planned on a token the host does not have (no
placeholders, unlike async scheduling). A prompt longer than a micro-batch's token budget
is the one exception: its chunks follow each other through the stages (nothing is sampled
from a non-final chunk). With S = 2::

    host:    plan A | submit A | plan B | submit B | finalize | collect A | commit A | plan A'...
    stage 0: ==== A ====|==== B ====|            |==== A' ====
    stage 1:            |==== A ====|==== B ====|           |==== A' ====

NOTE the invariants that keep it exact:
- A request in flight is never preempted, and never scheduled again while the token it
  waits for is in flight (``PipelineScheduler``): each request sees the steps a single
  batch would give it, its prompt cut into the same chunks.
- Every stage runs micro-batches in the order they were submitted, so blocks freed while a
  micro-batch is in flight (an abort, a stop string found in finalize) are written by
  their next owner only after it, on every stage.
- Finalize of committed outputs runs while the stages compute (async output processing),
  and after each commit when it is off; the output lag rules are those of the sync loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cadence.backend import ModelInput, SamplerOutput, WorkerLostError
from cadence.outputs import RequestOutput
from cadence.request import Request
from cadence.scheduler import Scheduler
from cadence.scheduling.loop import finalize_pending, rerun_alone
from cadence.step_plan import ScheduledRequest, StepPlan

if TYPE_CHECKING:
    from cadence.engine import LLMEngine

logger = logging.getLogger(__name__)


class PipelineScheduler(Scheduler):
    """``Scheduler`` for micro-batches: requests in flight sit out, and each micro-batch
    takes its share (1/S) of the active requests so the stages get balanced work.

    A prompt longer than one micro-batch's token budget is the exception: its next chunk
    may go into the next micro-batch while the chunks before it are in flight, so one long
    prompt fills the pipeline instead of crossing it chunk by chunk. Nothing is sampled
    from a non-final chunk, so no token is planned before it is known, and every stage runs
    the chunks in order, so each finds the K/V of those before it. A chunk's tokens count as
    computed from the moment it is submitted (``hold``), which is what places the next one;
    its blocks enter the prefix cache (and leave a sliding window) only once it is
    committed, and a micro-batch that fails takes its requests back to where its chunk
    began (``roll_back``), so their later chunks, computed on what it did not write, are
    computed again (a token the prompt's final chunk sampled meanwhile is dropped,
    ``PipelineLoop._complete``). When two micro-batches in a row fail, the reruns may cut
    the prompt differently from one process; each still computes the right tokens at the
    right positions.

    Preemption picks its victim from the tail among requests not in flight (the blocks of
    one in flight are in use on the device). When that would be the request that needs room
    itself while a lower-ranked request is in flight, it waits instead: this micro-batch
    stops growing and admits nothing, and once the one in flight is committed the next plan
    preempts the true tail, as one batch would.
    """

    def __init__(self, *args, num_stages: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_stages = num_stages
        self.in_flight: dict[str, int] = {}  # request id -> its tokens in flight
        self._cap = 1

    def hold(self, plan: StepPlan) -> None:
        for sr in plan.scheduled:
            rid = sr.request.request_id
            self.in_flight[rid] = self.in_flight.get(rid, 0) + sr.num_new_tokens
            sr.counted_from = sr.request.num_computed_tokens
            sr.request.num_computed_tokens += sr.num_new_tokens

    def release(self, plan: StepPlan) -> None:
        for sr in plan.scheduled:
            rid = sr.request.request_id
            left = self.in_flight.get(rid, 0) - sr.num_new_tokens
            if left > 0:
                self.in_flight[rid] = left
            else:
                self.in_flight.pop(rid, None)

    def roll_back(self, plan: StepPlan) -> None:
        """A submitted micro-batch failed: its requests go back to where its chunks began
        (later chunks of theirs in flight were computed on what it did not write)."""
        for sr in plan.scheduled:
            if sr.counted_from >= 0:
                sr.request.num_computed_tokens = min(sr.request.num_computed_tokens,
                                                     sr.counted_from)
                sr.counted_from = -1  # run again on its own, it is counted at its commit

    def forget_in_flight(self) -> None:
        """The backend lost every micro-batch in flight (its recovery recomputes them)."""
        self.in_flight.clear()

    def _account(self, entry: ScheduledRequest) -> None:
        if entry.counted_from < 0:
            super()._account(entry)  # run outside the pipeline (a micro-batch run again)
            return
        request = entry.request
        # Below zero while a failed micro-batch's later chunks drain: nothing to register.
        done = request.num_computed_tokens - self.in_flight.get(request.request_id, 0)
        self.block_manager.cache_full_blocks(request, max(0, done))

    def schedule(self) -> StepPlan:
        active = sum(1 for r in self.running if not r.is_finished) + len(self.waiting)
        concurrent = min(active, self.config.max_num_seqs)
        self._cap = max(1, -(-concurrent // self.num_stages))
        return super().schedule()

    def _batch_full(self, scheduled: list[ScheduledRequest]) -> bool:
        return len(scheduled) >= self._cap

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        # In flight with its prompt not all submitted: the next chunk may follow (class
        # docstring). A decode or a final chunk in flight has a token still to come.
        if request.request_id in self.in_flight and \
                request.num_computed_tokens >= request.num_tokens:
            return 0
        return super()._num_new_tokens(request, budget)

    def _preemption_victim(self, request: Request, num_new: int) -> Request | None:
        # From the tail, as the base rule, among requests not in flight and after
        # ``request`` (those before it may be in this micro-batch already). ``request``
        # itself only as the tail and not in flight (a prompt's next chunk may be).
        for r in reversed(self.running):
            if r is request:
                if self.running[-1] is request and request.request_id not in self.in_flight:
                    return request
                return None  # the tail is in flight: giving up this place would invert
            if r.request_id not in self.in_flight:
                return r
        return None


@dataclass(eq=False, slots=True)
class MicroBatch:
    plan: StepPlan
    model_input: ModelInput


class PipelineLoop:
    """The engine's step under pipeline parallel; uses ``Backend.submit``/``collect``.

    One ``step()``: plan and submit a micro-batch of requests not in flight, finalize the
    outputs committed before (the stages compute meanwhile), then, once S micro-batches are
    in flight (or nothing else can be planned), collect and commit the oldest.
    """

    def __init__(self, engine: LLMEngine, num_stages: int) -> None:
        self.engine = engine
        self.depth = num_stages
        self.in_flight: deque[MicroBatch] = deque()
        # Requests of a failed micro-batch while the ones after it are drained (_complete).
        self._void: frozenset[str] = frozenset()

    @property
    def has_in_flight(self) -> bool:
        return bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        e = self.engine
        e.guard.repair()
        times = e.stats.times
        plan = e.plan()
        if plan is None:
            return e._finish_step()
        t1 = time.perf_counter()
        if plan.is_empty and not self.in_flight:
            e._drain()
            times.add("drain", time.perf_counter() - t1)
            return e._finish_step()
        if plan.is_empty:
            # Every runnable request is in flight: commit the oldest micro-batch and plan
            # again now. Returning empty-handed would look like a stall to AsyncLLM, which
            # then waits for a command (up to a second) before the next step. At most one
            # level per stage: each pass commits one micro-batch.
            self._finalize_previous()
            self._complete()
            times.add("drain", time.perf_counter() - t1)
            return self.step()
        mi = e._build_input(plan)
        times.add("prepare", time.perf_counter() - t1)
        try:
            e.backend.submit(mi)
        except WorkerLostError as err:
            self._lost(err)
            return e._finish_step()
        except Exception:
            # Nothing was sent: the micro-batches before it finish first (the ranks
            # answer in order), then it runs on its own through the step guard.
            logger.warning("submitting a micro-batch failed; it is run again on its "
                           "own", exc_info=True)
            self.flush()
            rerun_alone(self.engine, plan)
        else:
            self.in_flight.append(MicroBatch(plan, mi))
            e.scheduler.hold(plan)
            if mi.sampling.grammar is not None:  # computed before the step was sent
                times.add("bitmask", mi.sampling.grammar.seconds)
        e.stats.num_steps += 1
        e.stats.num_scheduled_tokens += plan.num_batched_tokens
        self._finalize_previous()
        if len(self.in_flight) >= self.depth:
            self._complete()
        if not e.async_output:
            e._drain()
        return e._finish_step()

    def discard(self) -> None:
        """Forget the micro-batches in flight, which the backend dropped (an interrupt,
        ``LLMEngine.after_interrupt``): their requests go back to where their chunks began,
        so one kept past the interrupt computes them again."""
        for batch in self.in_flight:
            self.engine.scheduler.roll_back(batch.plan)
        self.in_flight.clear()
        self.engine.scheduler.forget_in_flight()

    def flush(self) -> None:
        """Collect and commit every micro-batch in flight (at shutdown too)."""
        while self.in_flight:
            self._complete()

    # ---- the parts of a step ----------------------------------------------------------
    def _finalize_previous(self) -> None:
        finalize_pending(self.engine)

    def _complete(self) -> None:
        """Collect the oldest micro-batch and commit it (or recover from its failure)."""
        e = self.engine
        t0 = time.perf_counter()
        try:
            out = e.backend.collect()
        except WorkerLostError as err:
            self._lost(err)
            return
        except Exception as err:  # noqa: BLE001  # that micro-batch failed; the ranks live
            failed = self.in_flight.popleft()
            e.scheduler.roll_back(failed.plan)
            e.scheduler.release(failed.plan)
            logger.warning("a micro-batch failed (%r); running it again on its own", err)
            # Later chunks of its requests still in flight ran on K/V it did not write: a
            # token one of them sampled (a prompt's final chunk) is dropped, not committed.
            outer = self._void
            self._void = outer | {sr.request.request_id for sr in failed.plan.scheduled}
            try:
                self.flush()
            finally:
                self._void = outer
            rerun_alone(self.engine, failed.plan)
            return
        t1 = time.perf_counter()
        e.stats.times.add("execute", t1 - t0)
        mb = self.in_flight.popleft()
        e.scheduler.release(mb.plan)
        indices = mb.model_input.sample_seq_indices
        if self._void:
            indices, out = _without(self._void, mb.plan, indices, out)
        touched = e.output_processor.commit(mb.plan.scheduled, indices, out,
                                            mb.model_input)
        e.scheduler.update_after_step(mb.plan)
        e._stamp_token_times(touched)
        e._pending += touched
        e.stats.times.add("commit", time.perf_counter() - t1)

    def _lost(self, err: WorkerLostError) -> None:
        self.discard()
        self.engine.guard.recover(err)


def _without(void: frozenset[str], plan: StepPlan, indices: list[int],
             out: SamplerOutput) -> tuple[list[int], SamplerOutput]:
    """The samples of ``plan`` minus those of requests in ``void``."""
    keep = [k for k, i in enumerate(indices) if plan.scheduled[i].request.request_id not in void]
    if len(keep) == len(indices):
        return indices, out
    logprobs = None if out.logprobs is None else [out.logprobs[k] for k in keep]
    return [indices[k] for k in keep], dataclasses.replace(
        out, sampled_token_ids=[out.sampled_token_ids[k] for k in keep], logprobs=logprobs)
