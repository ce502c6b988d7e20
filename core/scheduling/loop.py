"""Async scheduling's step loop: plan and submit step N+1 before step N's tokens reach the
host. No torch here; docs/async_scheduling.md tells the whole story.

One ``step()`` call, with step N in flight when it starts::

    host:   schedule N+1 | build N+1 | submit N+1 | finalize N-1 | collect N | commit N | advance N+1
    device: ======== forward + sample N ========================|=== forward + sample N+1 ===

NOTE the invariants that keep it exact:
- ``advance`` (end of the call that submitted a step) moves each running request's
  ``num_computed_tokens`` past the step and gives each request the step samples one
  placeholder, so the next ``schedule()`` plans around tokens not yet on the host. At most
  one step's placeholders exist at a time, and only as a count: ``output_token_ids``, text,
  logprobs and stats only ever hold committed tokens.
- ``commit`` of step N runs before ``advance`` of step N+1: blocks are registered in the
  prefix cache (``cache_full_blocks``) only up to tokens the device has computed and the
  host knows, and a request finished at commit N is never advanced into N+1.
- A request that stops at step N (EOS, stop id; a stop string one step later) was already
  planned into N+1: that step's token is dropped at commit, because the request is finished
  by then. Its blocks are freed at once: a step in flight may still write its slots, but
  the device runs steps in order, so whoever gets the blocks next writes after it.
- Every commit (``_complete``, ``_rerun``) comes after the finalize of the commits before
  it, which is what finds a stop string: the token after one is then dropped at commit,
  never appended and cut back after its time went into the latency metrics.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cadence.backend import ModelInput, PostSample, WorkerLostError
from cadence.outputs import RequestOutput
from cadence.request import Request, RequestStatus
from cadence.scheduling.placeholders import build_async_input
from cadence.step_plan import ScheduledRequest, StepPlan

if TYPE_CHECKING:
    from cadence.engine import LLMEngine

logger = logging.getLogger(__name__)

_FINISHED_AT_COMMIT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass(eq=False, slots=True)
class InFlightStep:
    """A submitted step not yet committed, and what ``advance`` did for it."""

    plan: StepPlan
    model_input: ModelInput
    advanced: list[ScheduledRequest] = field(default_factory=list)
    # Requests given a placeholder, and the row of this step's samples holding each one's
    # token: what the next step's ``placeholder_src`` names.
    placeholders: list[Request] = field(default_factory=list)
    rows: dict[int, int] = field(default_factory=dict)


class AsyncSchedulingLoop:
    """The engine's step when ``async_scheduling`` is on; uses ``Backend.submit``/``collect``.

    It drives the engine's own parts (scheduler, output processor, step guard); the engine
    delegates ``step()`` to it and asks ``has_in_flight`` before it calls itself idle.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.in_flight: deque[InFlightStep] = deque()

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
        if plan.is_empty and self.in_flight:
            # Nothing could be planned around the step in flight (its placeholders reach a
            # length limit, or blocks it frees are awaited): commit it and plan again now.
            # Returning empty-handed would look like a stall to AsyncLLM, which then waits
            # for a command. The second plan has nothing in flight: no third one.
            # Not timed as drain: _complete times its collect, finalize and commit itself.
            self.flush()
            return self.step()
        if plan.is_empty:
            e._drain()
            times.add("drain", time.perf_counter() - t1)
            return e._finish_step()
        step = InFlightStep(plan, build_async_input(plan, self.in_flight, e))
        times.add("prepare", time.perf_counter() - t1)
        try:
            e.backend.submit(step.model_input)
            self.in_flight.append(step)
        except WorkerLostError as err:
            self._lost(err)
            return e._finish_step()
        except Exception:  # re-run below, once the step before it is in
            logger.warning("submitting a step failed; it is run again on its own",
                           exc_info=True)
        self._finalize_previous()
        if self.in_flight and self.in_flight[0] is not step:
            self._complete(self.in_flight[0])
        if step in self.in_flight:
            self._advance(step)
        elif not self.in_flight:
            # Submitting it failed (the step before it, if any, is committed now), or the
            # step before it failed and took it along: run it the synchronous way.
            self._rerun(plan)
        if not e.async_output:
            e._drain()
        e.stats.num_steps += 1
        e.stats.num_scheduled_tokens += plan.num_batched_tokens
        return e._finish_step()

    def discard(self) -> None:
        """Forget the steps in flight, which the backend dropped (an interrupt,
        ``LLMEngine.after_interrupt``): the advance of the one advanced is undone, so a
        request kept past the interrupt computes those tokens again."""
        for step in self.in_flight:
            _undo(step)
        self.in_flight.clear()

    def flush(self) -> None:
        """Collect and commit every step in flight (at shutdown too)."""
        while self.in_flight:
            self._complete(self.in_flight[0])

    # ---- the parts of a step ----------------------------------------------------------
    def _finalize_previous(self) -> None:
        finalize_pending(self.engine)

    def _advance(self, step: InFlightStep) -> None:
        mi = step.model_input
        row_of = {id(step.plan.scheduled[s].request): j
                  for j, s in enumerate(mi.sample_seq_indices)}
        for sr in step.plan.scheduled:
            req = sr.request
            if req.status is not RequestStatus.RUNNING:
                continue  # finished (its token will be dropped), or aborted
            req.num_computed_tokens += sr.num_new_tokens
            step.advanced.append(sr)
            if sr.samples:
                req.num_output_placeholders += 1
                step.placeholders.append(req)
                step.rows[id(req)] = row_of[id(req)]

    def _complete(self, step: InFlightStep) -> None:
        """Collect the oldest step and commit it (or recover from its failure)."""
        e = self.engine
        if e._pending:
            # Committing around an empty plan (``step``) without a finalize in between.
            finalize_pending(e)
        t0 = time.perf_counter()
        try:
            out = e.backend.collect()
        except WorkerLostError as err:
            self._lost(err)
            return
        except Exception as err:  # noqa: BLE001  # that step failed; the device is intact
            self._failed(err)
            return
        t1 = time.perf_counter()
        e.stats.times.add("execute", t1 - t0)
        self.in_flight.popleft()
        for req in step.placeholders:
            req.num_output_placeholders -= 1
        touched = e.output_processor.commit(step.plan.scheduled,
                                            step.model_input.sample_seq_indices, out,
                                            step.model_input)
        self._cache_and_free(step.plan)
        e._stamp_token_times(touched)
        e._pending += touched
        e.stats.times.add("commit", time.perf_counter() - t1)

    def _cache_and_free(self, plan: StepPlan) -> None:
        """``Scheduler.update_after_step`` without the advance (done at submit time)."""
        e = self.engine
        bm = e.block_manager
        for sr in plan.scheduled:
            req = sr.request
            # Not yet freed: by identity, since its id may name a newer request by now.
            finished_now = req.status in _FINISHED_AT_COMMIT and e.scheduler.holds(req)
            if req.status is not RequestStatus.RUNNING and not finished_now:
                continue
            bm.cache_full_blocks(req)
            if finished_now:
                e.scheduler.free_request(req)

    # ---- failures ---------------------------------------------------------------------
    def _lost(self, err: WorkerLostError) -> None:
        self.in_flight.clear()
        self.engine.guard.recover(err)

    def _failed(self, err: Exception) -> None:
        """The oldest step failed with the device intact: the step after it was planned on
        its samples, so it is collected and dropped; the failed step's advance is undone and
        it runs again through the step guard, which isolates the request it fails on."""
        e = self.engine
        failed = self.in_flight.popleft()
        logger.warning("a step failed (%r); dropping the step planned after it and running "
                       "it again the synchronous way", err)
        while self.in_flight:
            self.in_flight.popleft()
            try:
                e.backend.collect()
            except WorkerLostError as lost:
                self._lost(lost)
                return
            except Exception:  # noqa: BLE001, S110  # expected: it had no samples to read
                pass
        _undo(failed)
        self._rerun(failed.plan)

    def _rerun(self, plan: StepPlan) -> None:
        # It follows a commit (of the step before it, or of a failed step run again): a
        # request that commit's stop string ends is not run again.
        finalize_pending(self.engine)
        rerun_alone(self.engine, plan)


def _undo(step: InFlightStep) -> None:
    """Take back ``_advance``: the step's samples will never be read."""
    for req in step.placeholders:
        req.num_output_placeholders -= 1
    for sr in step.advanced:
        if sr.request.status is RequestStatus.RUNNING:
            sr.request.num_computed_tokens -= sr.num_new_tokens
    step.placeholders.clear()
    step.advanced.clear()


# Shared with the pipeline loop (pipeline.py).

def finalize_pending(e: LLMEngine) -> None:
    """Finalize the outputs committed before (while the device computes what was
    submitted since)."""
    pending, e._pending = e._pending, []
    ts = time.perf_counter()
    if pending:
        e.output_processor.finalize(pending)
    e.stats.times.add("post_sample", time.perf_counter() - ts)


def rerun_alone(e: LLMEngine, plan: StepPlan) -> None:
    """Run a plan's still-running entries with ``execute``, nothing else in flight (the
    step guard finds the request a failure comes from), and commit them."""
    entries = [sr for sr in plan.scheduled if sr.request.status is RequestStatus.RUNNING]
    if not entries:
        return
    sub = StepPlan(scheduled=entries, num_decodes=sum(1 for s in entries if s.is_decode),
                   num_batched_tokens=sum(s.num_new_tokens for s in entries))
    for r in e.guard.run(sub, e._build_input(sub), PostSample(None)):
        touched = e.output_processor.commit(r.plan.scheduled,
                                            r.model_input.sample_seq_indices, r.output,
                                            r.model_input)
        e.scheduler.update_after_step(r.plan)
        e._stamp_token_times(touched)
        e._pending += touched
