"""The engine's view of one sequence being generated. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cadence.sampling_params import SamplingParams

#: The input id of a token that a step in flight has sampled but the host does not know yet
#: (async scheduling); the backend replaces it on the device before the forward.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished; ``is_finished`` relies on the ordering.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13  # the engine could not serve it (a step failed on it, a lost worker)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False, slots=True)
class Request:
    """One sequence: a prompt plus the tokens generated so far.

    A user request with ``n > 1`` becomes ``n`` of these (``parent_id`` ties them together,
    ``index`` orders them); they share prompt blocks through prefix caching.

    NOTE the one-step lag: ``output_token_ids`` is advanced by *commit* on the critical path
    right after sampling; everything host-side that depends on text (detokenization, stop
    strings, RequestOutput) is caught up later by *finalize*, which tracks its progress in
    ``num_finalized_tokens``. A stop string found by finalize truncates ``output_token_ids``
    back to the stop token, so a token sampled in the meantime never becomes visible.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every id that ends generation as EOS (generation_config.json may list several).
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    parent_id: str | None = None
    index: int = 0
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Per generated token: (sampled logprob, top ids, top logprobs, sampled rank) or None.
    output_logprobs: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Finalize-side progress (host work that lags one step).
    num_finalized_tokens: int = 0
    output_text: str = ""
    is_final_emitted: bool = False
    first_token_time: float | None = None
    # For the queue-time and inter-token-latency metrics: set by the scheduler when the
    # request first leaves the waiting queue, and by the engine at each commit.
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    # Opaque per-request state owned by the output processor (the detokenizer).
    detok_state: object = field(default=None, repr=False)
    # Async scheduling: tokens sampled by a step still in flight, counted in ``num_tokens``
    # (so the scheduler plans the next step around them) but not yet in ``output_token_ids``
    # (so nothing host-side ever sees them). Always 0 without async scheduling.
    num_output_placeholders: int = 0
    # Structured output: this sample's grammar matcher, fed each committed token
    # (core/structured_output/manager.py); None when the output is unconstrained.
    grammar: object = field(default=None, repr=False)
    # prompt_logprobs: entry t is the raw (logprob, rank, top ids, top logprobs) of prompt
    # token t + 1 given the tokens before it, None until computed. Only on the sample that
    # computes them for its user request (index 0); None everywhere else.
    prompt_logprobs: list | None = field(default=None, repr=False)
    # An embedding request's pooling progress (cadence.pooling.PoolingState); None for a
    # generation request. Such a request runs as a one-token greedy request whose token is
    # dropped: it finishes at the step that completes its prompt.
    pooling: object = field(default=None, repr=False)
    # SamplingParams.bad_words as token sequences (request_intake.bad_words_token_ids).
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # The LoRA adapter it runs with (cadence.lora.LoRARequest), None for the base model.
    # Its prefix-cache blocks are its adapter's own (``cache_namespace``).
    lora_request: object = None
    # Speculative decoding: the proposer's per-request state (cadence.spec_decode's n-gram
    # index); None until a draft is first asked for.
    spec_state: object = field(default=None, repr=False)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether this sample still has prompt logprobs to compute: its prefill then takes
        no prefix-cache hits (a cached token has no logits)."""
        pl = self.prompt_logprobs
        return bool(pl) and pl[-1] is None

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether this sample's prefill must compute every prompt token: for prompt
        logprobs, or for pooling that reads more than the last row."""
        return self.needs_prompt_logprobs or (self.pooling is not None
                                               and self.pooling.needs_every_row)

    @property
    def cache_namespace(self) -> object:
        """Whose prefix-cache blocks this request may share: the same tokens computed under
        another adapter are other K/V. 0 for the base model, else the adapter's id and
        folder (an id removed and given to another folder starts a namespace of its own)."""
        lora = self.lora_request
        return 0 if lora is None else (lora.lora_int_id, lora.lora_path)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return (len(self.prompt_token_ids) + len(self.output_token_ids)
                + self.num_output_placeholders)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        if i < n:
            return self.prompt_token_ids[i]
        j = i - n
        return self.output_token_ids[j] if j < len(self.output_token_ids) \
            else PLACEHOLDER_TOKEN_ID

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        known = n + len(self.output_token_ids)
        if end > known:  # async scheduling: tokens still on the device
            head = self.token_slice(start, known) if start < known else []
            return head + [PLACEHOLDER_TOKEN_ID] * (end - max(start, known))
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """Whether the next step computes more than the one newest token."""
        return self.num_tokens - self.num_computed_tokens > 1
