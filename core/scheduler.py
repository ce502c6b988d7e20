"""Continuous batching under a token budget (vLLM V1's single rule). No torch here.

Each request has ``num_computed_tokens``; every step, computed tokens catch up with
``request.num_tokens`` under ``max_num_batched_tokens``. A prompt is just many uncomputed
tokens (chunked when it does not fit), a decode is one; there are no separate phases.

NOTE the engine's side of the contract:
- after a step it appends the sampled tokens, marks EOS/length finishes by setting
  ``request.status``, then calls ``update_after_step(plan)``; finished requests are dropped
  from the batch at the next ``schedule()`` and their blocks stay until ``free_request``.
- ``settle(request)`` is called on a running request before it is preempted, so its pending
  output is finalized first (vLLM #8267, #9342). If settle finishes it, it is freed instead.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Protocol

from cadence.block_manager import BlockManager
from cadence.config import SchedulerConfig
from cadence.request import Request, RequestStatus
from cadence.sched_policy import SchedulingPolicy, WaitingQueue, make_policy
from cadence.spec_decode import Speculator
from cadence.step_plan import RequestTooLargeError, ScheduledRequest, StepPlan

# What commit sets on the sampled token itself; anything else finished elsewhere.
_FINISHED_AT_COMMIT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class AdmissionRule(Protocol):
    """A limit on which waiting requests may join the batch beside the running ones (LoRA's
    distinct adapters per step: cadence/lora/admission.py). A request it turns away waits,
    and those behind it may go first."""

    def start(self, running: list[Request]) -> None:
        """Called once per step before admission, with the running batch."""

    def admits(self, request: Request) -> bool: ...

    def admitted(self, request: Request) -> None: ...


# How many waiting requests an admission rule may turn away in one step before the rest
# wait for the next: bounds the step's cost with a long queue.
_MAX_SKIPPED = 256


class Scheduler:
    """Admits, batches and preempts requests; owns the waiting queue and the running batch.

    ``running`` is kept sorted by the policy key, so it is served in policy order and its tail
    is always the lowest-priority request: the preemption victim is never a request already
    scheduled earlier in the same step.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_manager: BlockManager,
        settle: Callable[[Request], None] | None = None,
        policy: SchedulingPolicy | None = None,
        admission: AdmissionRule | None = None,
        speculator: Speculator | None = None,
    ):
        self.config = scheduler_config
        # Drafts for running decodes (speculative decoding, cadence/spec_decode), or None.
        self.speculator = speculator
        # A capacity rule beyond blocks and budget (LoRA's max_loras), or None.
        self.admission = admission
        self.block_manager = block_manager
        self.settle = settle
        self.policy = policy if policy is not None else make_policy(scheduler_config.policy)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Set by a step that waits for blocks a step in flight will free (see
        # ``_preemption_victim``); nothing new is admitted in that step.
        self._waiting_for_commit = False

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def holds(self, request: Request) -> bool:
        """Whether this very request is still known here (not yet freed); its id may
        already name a newer request once it has been."""
        return self._requests.get(request.request_id) is request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or any(not r.is_finished for r in self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already scheduled")
        self._requests[request.request_id] = request
        self.waiting.push(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Remove the request and free its blocks; the caller sets its status."""
        request = self._requests.get(request_id)
        if request is not None:
            self.free_request(request)
        return request

    def free_request(self, request: Request) -> None:
        """Forget the request and free its blocks; idempotent. A request already freed
        does nothing, even where a newer request now holds its id (the queues and the
        block tables are keyed by id, and an old sample's late finalize must not free the
        new one's blocks)."""
        if self._requests.get(request.request_id) is not request:
            return
        del self._requests[request.request_id]
        self.waiting.remove(request.request_id)
        if request in self.running:
            self.running.remove(request)
        self.block_manager.free(request)

    def schedule(self) -> StepPlan:
        # Finished requests (EOS/length set by commit) leave the batch now; the engine frees
        # their blocks once it has finalized them.
        self.running = [r for r in self.running if not r.is_finished]
        self._waiting_for_commit = False
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        # After a preemption memory is tight: admitting new work would only thrash.
        if not preempted and not self._waiting_for_commit:
            budget = self._schedule_waiting(budget, scheduled)
        if self.speculator is not None and budget > 0 and not preempted:
            # Not after a preemption: the blocks it freed are for the requests it served.
            self._add_drafts(scheduled, budget)
        decodes = [s for s in scheduled if s.is_decode]
        others = [s for s in scheduled if not s.is_decode]
        return StepPlan(
            scheduled=decodes + others,
            num_decodes=len(decodes),
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
            preempted=preempted,
        )

    def update_after_step(self, plan: StepPlan) -> None:
        """Advance computed tokens and register newly full blocks in the prefix cache.

        A request the step's commit just finished (EOS, a stop id, a length limit) still
        holds the blocks this step computed: they are registered first, so a shared prompt
        is reused even by requests that end after one token (scoring, classification), and
        then freed at once, since no later step can read them. Its output is finalized
        later as usual; freeing again then is a no-op.
        """
        for entry in plan.scheduled:
            request = entry.request
            status = request.status
            finished_now = status in _FINISHED_AT_COMMIT and self.holds(request)
            # Aborted, preempted or finished by a stop string since scheduling: its blocks
            # are gone or were given back; nothing to advance.
            if status != RequestStatus.RUNNING and not finished_now:
                continue
            self._account(entry)
            if finished_now:
                self.free_request(request)

    def _account(self, entry: ScheduledRequest) -> None:
        """Count a committed entry's tokens as computed and register its full blocks. Of
        its drafts only the kept ones count: the K/V of the others, computed on tokens the
        request does not have, is overwritten by the steps that reach their positions."""
        drafts = len(entry.spec_token_ids)
        entry.request.num_computed_tokens += entry.num_new_tokens - drafts + entry.num_accepted
        if drafts:
            self.speculator.observe(entry.request, drafts, entry.num_accepted)
        self.block_manager.cache_full_blocks(entry.request)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to compute this step; 0 when a prefill must wait for a later step.

        A partial chunk is cut at a block boundary. Chunk boundaries then do not depend on
        how many decodes share the step, so a prompt is split the same way whatever else
        runs, with async output processing on or off (its lagging step takes one token of
        the budget), and its K/V come out bit for bit the same.
        """
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining <= budget:
            return remaining
        if not self.config.enable_chunked_prefill:
            return 0
        block_size = self.block_manager.block_size
        aligned = budget - (request.num_computed_tokens + budget) % block_size
        if aligned > 0:
            return aligned
        # A budget below one block (a config that small) must still make progress.
        return budget if self.config.max_num_batched_tokens < block_size else 0

    def _batch_full(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether this step takes no more requests (beyond the token budget and
        ``max_num_seqs``); a pipeline's micro-batches are capped here."""
        return False

    def _check_fits(self, request: Request, num_new_tokens: int) -> None:
        bm = self.block_manager
        needed = bm.num_blocks_needed(request, num_new_tokens)
        if needed > bm.num_blocks:
            raise RequestTooLargeError(
                request,
                f"request {request.request_id!r} needs {needed} KV blocks of "
                f"{bm.block_size} tokens but the whole cache has {bm.num_blocks}; "
                "give the KV cache more memory or lower max_model_len / max_tokens"
            )

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and not self._batch_full(scheduled):
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            if not self._reserve(request, num_new, preempted):
                break  # it was the last request and gave up its own place
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _reserve(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Allocate for a running request, preempting from the tail; False if it lost its
        place or waits for a step in flight to free room."""
        bm = self.block_manager
        if bm.holds(request, num_new):
            # Most decode steps: the table already covers the token (15 of 16 steps at
            # block size 16), so it fits and nothing is allocated.
            return True
        self._check_fits(request, num_new)
        while not bm.can_allocate(request, num_new):
            victim = self._preemption_victim(request, num_new)
            if victim is None:
                self._waiting_for_commit = True
                return False
            self._preempt(victim, preempted)
            if victim is request:
                return False
        bm.allocate(request, num_new)
        return True

    def _preemption_victim(self, request: Request, num_new: int) -> Request | None:
        """Whom to preempt so ``request`` fits: the tail of the batch (the lowest priority,
        ``request`` itself when it is the tail). None: wait instead, because a step in
        flight will free the room once committed (the in-flight step strategies)."""
        return self.running[-1]

    def _preempt(self, victim: Request, preempted: list[Request]) -> None:
        if self.settle is not None:
            self.settle(victim)
        if victim.is_finished:
            # Settle found a stop in its pending output: it is done, and freeing it makes
            # the space. The engine normally freed it inside settle; this is idempotent.
            self.free_request(victim)
            return
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.push(victim)
        preempted.append(victim)

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Give decodes their drafts from what the step leaves over: every request has its
        own tokens first, and drafts take only free blocks, never preempting anyone."""
        bm = self.block_manager
        for i, entry in enumerate(scheduled):
            if budget <= 0:
                return
            if not entry.is_decode:
                continue
            request = entry.request
            drafts = self.speculator.drafts(request, budget)
            n = 1 + len(drafts)
            if not drafts or not (bm.holds(request, n) or bm.can_allocate(request, n)):
                continue
            bm.allocate(request, n)
            scheduled[i] = ScheduledRequest(request, n, drafts)
            budget -= len(drafts)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests; returns the budget left."""
        rule = self.admission
        if rule is not None:
            rule.start(self.running)
        skipped: list[Request] = []  # turned away by the rule; back in the queue after
        try:
            return self._admit_waiting(budget, scheduled, rule, skipped)
        finally:
            for request in skipped:
                self.waiting.push(request)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest],
                       rule: AdmissionRule | None, skipped: list[Request]) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not self._batch_full(scheduled):
            request = self.waiting.peek()
            if request.is_finished:
                self.waiting.pop()
                continue
            if rule is not None and not rule.admits(request):
                if len(skipped) >= _MAX_SKIPPED:
                    break
                skipped.append(self.waiting.pop())
                continue
            num_cached = bm.get_computed_blocks(request)
            request.num_computed_tokens = num_cached
            num_new = self._num_new_tokens(request, budget)
            if num_new > 0:
                self._check_fits(request, num_new)
            if num_new == 0 or not bm.can_allocate(request, num_new):
                # Head of line: nothing behind it may overtake it (FCFS fairness). Give back
                # the prefix hits; the lookup is repeated next step.
                bm.free(request)
                request.num_computed_tokens = 0
                break
            bm.allocate(request, num_new)
            self.waiting.pop()
            if request.num_preemptions == 0:
                # Prompt-cache hits as first seen, for usage reporting.
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()  # the queue-time metric
            request.status = RequestStatus.RUNNING
            if rule is not None:
                rule.admitted(request)
            bisect.insort(self.running, request, key=self.policy.key)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget
