"""What the engine does when a step fails: the failing request ends alone, a lost worker is
restarted. No torch here; docs/reliability.md tells the whole story.

Two kinds of failure reach the engine from ``Backend.execute``:

- ``WorkerLostError``: the device state is gone (the worker died or froze, or the device
  context is poisoned). Every live request ends with ``finish_reason="error"``, the KV
  cache's bookkeeping is reset (the blocks' contents died with the worker, so the prefix
  cache must forget them too), and the backend is restarted while the restart budget lasts.
- Anything else: the step failed, the device state is intact. The step's requests are run
  again in halves, then quarters, until every failing group is one request; that request
  ends with an error, every other one gets its token from the half it ran in. A fault that
  does not depend on the batch costs about ``2 * log2(batch)`` extra forwards, once.

NOTE re-running is safe because nothing of a failed step was committed: the scheduler
advances ``num_computed_tokens`` only after a step succeeds (under pipeline parallel it is
advanced at submit, and a failed micro-batch's ``roll_back`` undoes that first), and the
backend contract says writing the same K/V to the same slots again is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.backend import Backend, ModelInput, PostSample, SamplerOutput, WorkerLostError
from cadence.step_plan import ScheduledRequest, StepPlan

logger = logging.getLogger(__name__)


class EngineFailedError(RuntimeError):
    """The engine cannot serve any more: its worker was lost and may not be restarted."""


@dataclass(slots=True)
class StepResult:
    """One group of a step's requests that ran: what to commit."""

    plan: StepPlan
    model_input: ModelInput
    output: SamplerOutput


class StepGuard:
    """Runs a step's ``execute`` and turns its failures into per-request errors or a restart.

    The engine hands it the callbacks it needs, so this module knows the engine's parts only
    through them: ``build_input`` (a plan's ``ModelInput``), ``fail_request`` (end one
    parent request with an error), ``fail_all`` (end every live request) and ``reset_kv``
    (forget the KV cache's contents after a restart, given the new block count).
    """

    def __init__(self, backend: Backend, max_restarts: int,
                 build_input: Callable[[StepPlan], ModelInput],
                 fail_request: Callable[[str, str], None], fail_all: Callable[[str], None],
                 reset_kv: Callable[[int], None]) -> None:
        self.backend = backend
        self.max_restarts = max_restarts
        self.restarts = 0
        #: A lost worker waits for ``repair`` (read from other threads for ``/health``).
        self.restart_pending = False
        self._restart_counts = True  # whether the planned restart spends one of the budget
        self._build_input = build_input
        self._fail_request = fail_request
        self._fail_all = fail_all
        self._reset_kv = reset_kv

    def run(self, plan: StepPlan, model_input: ModelInput,
            post_sample: PostSample) -> list[StepResult]:
        """Execute the step; return the groups that ran (all of it, when nothing failed)."""
        try:
            out = self.backend.execute(model_input, post_sample)
        except WorkerLostError as e:
            if not post_sample.called:
                post_sample()
            self.recover(e)
            return []
        except Exception as e:
            if not post_sample.called:
                post_sample()
            if len(plan.scheduled) == 1:
                return self._isolate(plan.scheduled, e)
            logger.warning("a step of %d requests failed (%r); running them in smaller groups "
                           "to find the one it fails on", len(plan.scheduled), e)
            return self._isolate(plan.scheduled, e)
        except BaseException:
            if not post_sample.called:
                post_sample()
            raise
        if not post_sample.called:
            post_sample()  # a backend that never calls it stays correct, without overlap
        return [StepResult(plan, model_input, out)]

    def check_health(self) -> None:
        """Between steps: if the backend reports its worker gone, end every request now (the
        restart waits for ``repair``, so their errors can be delivered first)."""
        if self.restart_pending:
            return
        try:
            self.backend.check_health(deep=True)
        except WorkerLostError as e:
            self.recover(e)

    def after_interrupt(self, loop: Any) -> None:
        """After an interrupt left the engine's step (``LLMEngine.after_interrupt``): drop
        the steps in flight, the engine's record of them (``loop``, the step loop of async
        scheduling or the pipeline, or None) and the backend's; a backend that cannot
        (its worker stopped, a second interrupt) gets a restart, not counted against the
        budget."""
        # Only async scheduling and the pipeline hand steps over with ``submit``; otherwise
        # only a backend that overrides ``discard_in_flight`` can hold one (a worker of its
        # own between ``execute``'s halves), and the default would restart it needlessly.
        if loop is None and \
                type(self.backend).discard_in_flight is Backend.discard_in_flight:
            self.check_health()
            return
        if loop is not None:
            loop.discard()
        logger.info("interrupted: dropping the steps in flight (an interrupt while they "
                    "finish restarts the backend instead)")
        try:
            self.backend.discard_in_flight()
        except WorkerLostError as e:
            self.recover(e)
            return
        except Exception as e:  # noqa: BLE001  # the device state is unknown: start afresh
            self.recover(WorkerLostError(
                f"a step was interrupted, and dropping the steps in flight failed ({e!r}); "
                "the backend is restarted", interrupted=True))
            return
        except BaseException:
            # A second interrupt: what it cut short is unknown, so start afresh.
            self.recover(WorkerLostError("a step was interrupted twice; the backend is "
                                         "restarted", interrupted=True))
            raise
        self.check_health()

    def recover(self, error: WorkerLostError) -> None:
        """End every request with the error; plan a restart, or give up (raises
        ``EngineFailedError``)."""
        if error.interrupted:
            logger.warning("%s", error)
        else:
            logger.error("the backend's worker was lost: %s", error)
        can_restart = error.restartable and (error.interrupted
                                             or self.restarts < self.max_restarts)
        if can_restart:
            message = f"{error}; the engine is restarting it"
        elif error.restartable:
            message = (f"{error}; not restarting it: {self.restarts} restarts used of "
                       f"max_worker_restarts={self.max_restarts}")
        else:
            message = f"{error}; this backend cannot restart in this process"
        self._fail_all(message)
        if not can_restart:
            raise EngineFailedError(message) from error
        # A loss already waiting for its restart keeps it counted.
        self._restart_counts = (self.restart_pending and self._restart_counts) \
            or not error.interrupted
        self.restart_pending = True

    def repair(self) -> None:
        """Restart the backend if ``recover`` planned it; a no-op otherwise."""
        if not self.restart_pending:
            return
        if self._restart_counts:
            logger.warning("restarting the backend (%d of %d restarts)", self.restarts + 1,
                           self.max_restarts)
        else:
            logger.warning("restarting the backend after an interrupted step")
        try:
            num_blocks = self.backend.restart()
        except Exception as e:
            # A restart that fails is a failure whatever it was owed to; past the budget the
            # engine stops retrying it.
            self.restarts += 1
            if self.restarts >= self.max_restarts:
                self.restart_pending = False
                raise EngineFailedError(
                    f"restarting the backend failed ({e!r}); {self.restarts} restarts used of "
                    f"max_worker_restarts={self.max_restarts}") from e
            raise
        # Counted once it ends: a restart that an interrupt cut short is tried again at the
        # next step, not spent twice.
        self.restarts += int(self._restart_counts)
        self._reset_kv(num_blocks)
        self.restart_pending = False
        logger.warning("the backend is serving again")

    # ---- finding the request a step fails on --------------------------------------------
    def _isolate(self, entries: list[ScheduledRequest], error: Exception) -> list[StepResult]:
        if len(entries) == 1:
            req = entries[0].request
            logger.error("request %r fails the step: %r", req.parent_id, error)
            self._fail_request(req.parent_id, "the engine failed on this request: "
                               f"{describe_failure(error)}")
            return []
        half = len(entries) // 2
        results = []
        for group in (entries[:half], entries[half:]):
            # Failing a request ends all its samples: a sibling in this group is gone.
            group = [e for e in group if not e.request.is_finished]
            if not group:
                continue
            sub = _sub_plan(group)
            mi = self._build_input(sub)
            try:
                out = self.backend.execute(mi, PostSample(None))
            except WorkerLostError as e:
                self.recover(e)
                return []
            except Exception as e:
                results += self._isolate(group, e)
            else:
                results.append(StepResult(sub, mi, out))
        return results


def _sub_plan(entries: list[ScheduledRequest]) -> StepPlan:
    """A plan of some of a step's entries, in the step's order (decodes stay first)."""
    return StepPlan(scheduled=list(entries),
                    num_decodes=sum(1 for e in entries if e.is_decode),
                    num_batched_tokens=sum(e.num_new_tokens for e in entries))


def describe_failure(error: Any) -> str:
    """One line for a client: the exception's own message, without a traceback."""
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__
