"""The step protocol of an executor whose ranks are other processes (mp.py's pipes, Ray's
actors): every step goes to every rank, one reply comes back from each, and the replies
decide between a result, a failed step and a lost group. The transport is the subclass's
(``_send_all``, ``_wait``, ``_read``, ``_kill_ranks``), as are starting and stopping ranks.

Each step's ``ModelInput`` goes to every rank; the engine runs the previous step's finalize
(``post_sample``) while the ranks compute, then reads one reply per rank: the output rank's
samples, an acknowledgement from the others. Reading every rank's reply is what turns a
rank that died, hung or failed into an error at once instead of a hang in the next
collective.

NOTE failures: a rank that is gone (it died) or that reports an error while another rank is
still computing (that one is stuck in a collective waiting for it) means the group is gone:
every rank is killed and ``WorkerLostError`` raised, so the engine fails every pending
request and restarts the group (or stops, past its restart budget). A step that failed on
every rank alike (a bad input seen before any collective) is a failure of that step only,
as with one process.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

from cadence.backend import (
    Backend,
    ModelInput,
    PostSample,
    ProbeResult,
    SamplerOutput,
    WorkerLostError,
)
from cadence.config import EngineConfig
from cadence.executor.pipes import START_NOTICE_S, on_interrupt

logger = logging.getLogger(__name__)

# After one rank fails a step, how long the others get to fail it too before the group
# counts as broken (they fail at the same point when the input itself was bad).
PEER_GRACE_S = 5.0


class _RankGone(Exception):
    """A rank's reply cannot come: it died (the message says how)."""


class RankGroup(Backend):
    """Runs ``backend_cls`` as ``world_size`` ranks in other processes (tensor-parallel
    ranks or pipeline stages); a ``Backend`` to the engine. ``load_model`` (the subclass's)
    starts the ranks, ``allocate_kv_cache`` waits for them.

    Steps in flight: two under async scheduling; one per stage under pipeline parallel
    (each a micro-batch of other requests; a stage takes them in the order they were sent).
    """

    executor_name = "?"
    #: Whether a step's grammar bitmask may follow the step as a message of its own (a rank
    #: that reads its inputs in order gets it while it runs the step's forward); otherwise
    #: it is computed before the step and travels inside it.
    sends_bitmask_late = True

    def __init__(self, backend_cls: type[Backend], config: EngineConfig) -> None:
        super().__init__(config)
        self.backend_cls = backend_cls
        self.name = backend_cls.name
        self.supports_async_scheduling = backend_cls.supports_async_scheduling
        self.supports_prompt_logprobs = backend_cls.supports_prompt_logprobs
        self.supports_pooling = getattr(backend_cls, "supports_pooling", False)
        self.supports_lora = getattr(backend_cls, "supports_lora", False)
        self.supports_speculative = getattr(backend_cls, "supports_speculative", False)
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        # The rank whose samples come back: rank 0, or the last stage's first rank (the
        # stage that computes the logits).
        self.output_rank = self.world_size - parallel.tensor_parallel_size \
            if parallel.pipeline_parallel_size > 1 else 0
        self.max_in_flight = max(2, parallel.pipeline_parallel_size)
        self.step_timeout_s = config.fault_config.step_timeout_s
        limit = config.fault_config.startup_timeout_s
        #: How long the ranks may take to be placed and loaded; None: no limit.
        self.startup_timeout_s: float | None = limit if math.isfinite(limit) else None
        self._start_began = time.monotonic()  # load_model's start: one deadline for all
        self._in_flight = 0
        # Per step in flight, oldest first: why its late bitmask could not be computed
        # (None: it was, or it needed none). Raised when the step is collected.
        self._bitmask_failures: deque[BaseException | None] = deque()
        self._failure: str | None = None
        self._failure_interrupted = False  # the group was stopped after an interrupt
        self.runtime_info: dict[str, str] = {}

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "executor")

    def rank_spec(self, rank: int, init_method: str) -> dict:
        """What rank ``rank`` is started with (core/executor/worker.py's ``RankRunner``)."""
        import dataclasses

        parallel = self.config.parallel_config.with_rank(rank)
        return {"config": dataclasses.replace(self.config, parallel_config=parallel),
                "rank": rank, "world_size": self.world_size, "init_method": init_method,
                "join_timeout": self.step_timeout_s, "output_rank": self.output_rank,
                "backend": self.backend_cls.name}

    def allocate_kv_cache(self) -> int:
        # Bounded: a rank stuck in its start (a lock held by a stuck process) must fail the
        # start, not hold it forever.
        replies = self._gather(timeout=self._startup_left(), starting=True)
        errors = [(r, rep) for r, rep in enumerate(replies) if rep and rep[0] == "error"]
        if errors:
            self._kill_ranks()  # the others may be waiting for it in the rendezvous
            self.shutdown()
            rank, (_, user_error, message, tb) = errors[0]
            if user_error:  # a bad model folder, a KV cache too small: the user's to fix
                raise ValueError(f"rank {rank} of {self.world_size}: {message}")
            raise RuntimeError(f"rank {rank} of {self.world_size} failed to start: "
                               f"{message}\n{tb}")
        # Equal shards give equal caches; the smallest is what every rank can hold.
        num_blocks = min(rep[1] for rep in replies)
        parallel = self.config.parallel_config
        self.runtime_info = {**replies[0][2], "executor": self.executor_name,
                             "tensor_parallel_size": str(parallel.tensor_parallel_size),
                             "pipeline_parallel_size": str(parallel.pipeline_parallel_size)}
        held = [f"rank {r}: {rep[2]['experts_held']}" for r, rep in enumerate(replies)
                if "experts_held" in rep[2]]
        if held:  # expert parallel: which experts each rank holds
            self.runtime_info["experts_held"] = "; ".join(held)
        return num_blocks

    # -- steps ------------------------------------------------------------------------------

    # The transport, which each executor brings: send to every rank, wait for some of them
    # to have a reply, read one rank's next reply (``_RankGone`` when it died), kill them.

    def _send_all(self, msg: Any) -> None:
        raise NotImplementedError

    def _wait(self, ranks: list[int], timeout: float | None) -> list[int]:
        raise NotImplementedError

    def _read(self, rank: int) -> Any:
        raise NotImplementedError

    def _kill_ranks(self) -> None:
        raise NotImplementedError

    def _dead_rank(self, failed: list[int] | None = None) -> str | None:
        """Why the group lost a step when a rank that died is the cause (its peers'
        failures would otherwise be what the error names); None when the transport cannot
        tell, or no rank died."""
        return None

    def _startup_left(self) -> float | None:
        """What is left of the start-up deadline (counted from ``load_model``); None: no
        deadline."""
        if self.startup_timeout_s is None:
            return None
        return max(0.0, self._start_began + self.startup_timeout_s - time.monotonic())

    def _lost(self, message: str, interrupted: bool = False) -> WorkerLostError:
        self._kill_ranks()
        self._in_flight = 0
        self._bitmask_failures.clear()
        self._failure = message  # what /health reports until a restart
        self._failure_interrupted = interrupted
        return self._failure_error()

    def _failure_error(self) -> WorkerLostError:
        return WorkerLostError(self._failure, interrupted=self._failure_interrupted)

    def _gather(self, timeout: float | None, starting: bool = False) -> list[Any]:
        """One reply from every rank, in rank order. Raises ``WorkerLostError`` (all ranks
        killed) when one dies, or none replies within ``timeout``, or one fails while
        another does not answer within ``PEER_GRACE_S``."""
        replies: dict[int, Any] = {}
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        failed_at, failed_rank = None, None
        while len(replies) < self.world_size:
            waiting = [r for r in range(self.world_size) if r not in replies]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if failed_at is not None:
                left = max(0.0, failed_at + PEER_GRACE_S - time.monotonic())
            # A start waits in slices, saying which ranks are still loading after each.
            notice = starting and failed_at is None and (left is None or left > START_NOTICE_S)
            ready = self._wait(waiting, START_NOTICE_S if notice else left)
            if not ready and notice:
                logger.warning("rank(s) %s of %d still starting after %.0f s (a first start "
                               "builds the CPU kernels; the start gives up after %s s, "
                               "--startup-timeout)", waiting, self.world_size,
                               time.monotonic() - self._start_began,
                               "no" if self.startup_timeout_s is None else
                               f"{self.startup_timeout_s:g}")
                continue
            if not ready:
                late = waiting
                if failed_at is not None:
                    raise self._lost(self._dead_rank() or
                                     f"rank {failed_rank} of {self.world_size} failed a step "
                                     f"while rank(s) {late} still ran it; every rank was "
                                     f"stopped:\n{replies[failed_rank][1]}")
                what = "were not ready" if starting else "gave no reply"
                limit = "--startup-timeout, startup_timeout" if starting else "step_timeout"
                seconds = self.startup_timeout_s if starting else timeout
                also = ""
                if self._in_flight and not starting:
                    # Later steps in flight (a pipeline): a rank that answered this step but
                    # not the next one stopped as well, and the late ones may only be
                    # waiting for its activations; it is named with them.
                    stuck = [r for r in sorted(replies) if not self._wait([r], 0)]
                    if stuck:
                        late = sorted(late + stuck)
                        also = (f"; rank(s) {stuck} answered this step but not the next "
                                "one, and a later stage waits on an earlier one")
                raise self._lost(f"rank(s) {late} of {self.world_size} {what} within "
                                 f"{seconds:g} s ({limit}){also}; every rank was killed")
            for rank in ready:
                try:
                    replies[rank] = self._read(rank)
                except _RankGone as gone:
                    where = " during start-up" if starting else ""
                    raise self._lost(f"rank {rank} of {self.world_size} {gone}{where}; every "
                                     "rank was stopped") from None
                if isinstance(replies[rank], tuple) and replies[rank][0] == "error":
                    if starting:  # the others may wait for it in the rendezvous: stop now
                        return [replies.get(r) for r in range(self.world_size)]
                    if failed_at is None:
                        failed_at, failed_rank = time.monotonic(), rank
        return [replies[r] for r in range(self.world_size)]

    def submit(self, model_input: ModelInput) -> None:
        if self._failure is not None:  # stopped between steps (an interrupted step)
            raise self._failure_error()
        assert self._in_flight < self.max_in_flight, \
            f"at most {self.max_in_flight} steps in flight"
        grammar = model_input.sampling.grammar
        late = grammar is not None and not grammar.is_ready and self.sends_bitmask_late
        if grammar is not None and not late:
            grammar.get()  # inside the step, computed before it goes out
        with on_interrupt(self._interrupted):  # from here on, the ranks hold a step
            self._submit(model_input, grammar if late else None)

    def _submit(self, model_input: ModelInput, grammar: Any) -> None:
        """Send the step, then its bitmask when ``grammar`` (one not computed yet) is given."""
        self._send_all(model_input)
        self._in_flight += 1
        failure = None
        if grammar is not None:
            # Structured output: the ranks run the forward while the bitmask is computed
            # here; it follows the step down their pipes, and they wait for it to sample.
            try:
                value = grammar.get()
            except Exception as e:  # noqa: BLE001  # raised at collect, once the ranks reply
                value, failure = None, e
            self._send_all(("bitmask", value))  # None: the ranks fail the step
        self._bitmask_failures.append(failure)

    def discard_in_flight(self) -> None:
        """Read and drop every rank's reply to each step in flight; ``WorkerLostError`` if
        an interrupt already stopped the ranks (or one dies meanwhile)."""
        if self._failure is not None:
            raise self._failure_error()
        with on_interrupt(self._interrupted):
            while self._in_flight:
                self._in_flight -= 1
                replies = self._gather(self.step_timeout_s)
                # A step that failed is dropped too, unless only some ranks failed it.
                errors = [r for r, rep in enumerate(replies) if isinstance(rep, tuple)]
                if errors and len(errors) < len(replies):
                    raise self._lost(f"rank(s) {errors} failed a step the others ran, so "
                                     "the group's state is inconsistent; every rank was "
                                     f"stopped:\n{replies[errors[0]][1]}")
        self._bitmask_failures.clear()

    def _interrupted(self, error: BaseException) -> None:
        self._lost(f"a step was interrupted ({type(error).__name__}) while the ranks ran "
                   "it; every rank was stopped, so that no later step reads its replies",
                   interrupted=True)

    def collect(self) -> SamplerOutput:
        if self._failure is not None:  # stopped while this step was in flight
            raise self._failure_error()
        assert self._in_flight, "collect() without submit()"
        self._in_flight -= 1
        with on_interrupt(self._interrupted):
            replies = self._gather(self.step_timeout_s)
        failure = self._bitmask_failures.popleft() if self._bitmask_failures else None
        if failure is not None:
            raise failure  # every rank failed the step for want of it
        errors = [r for r, rep in enumerate(replies) if isinstance(rep, tuple)]
        if errors and len(errors) < len(replies):
            raise self._lost(self._dead_rank(errors) or
                             f"rank(s) {errors} failed a step the others ran, so the group's "
                             f"state is inconsistent; every rank was stopped:\n"
                             f"{replies[errors[0]][1]}")
        if errors:
            raise RuntimeError(f"the step failed on every rank:\n{replies[0][1]}")
        return replies[self.output_rank]

    def execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        self.submit(model_input)
        try:
            post_sample()
        finally:
            # Never leave the ranks running while the caller raises: the next step would
            # race them for the KV cache.
            out = self.collect()
        return out

    def forward(self, model_input: ModelInput) -> Any:
        self.submit(model_input)

    def sample(self, logits: Any, sampling: Any) -> Any:
        return None

    def to_host(self, sampled: Any) -> SamplerOutput:
        return self.collect()

    def env_info(self) -> dict[str, str]:
        return dict(self.runtime_info)
