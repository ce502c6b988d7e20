"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability and its rank (1 = most likely) in the raw distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob (the sampled token plus the top-k), like vLLM.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` samples of a request.

    In streaming (delta) mode ``text``/``token_ids``/``logprobs`` hold only what is new since
    the previous output; otherwise they hold everything generated so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # "stop", "length", "abort", "error" (see RequestOutput.error) or None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What the engine emits for a request: once per step it progressed, and exactly one
    output with ``finished=True`` at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    #: With ``SamplingParams.prompt_logprobs``: per prompt token, its logprob and the most
    #: likely tokens at its position, as for sampled tokens; the first entry is None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    #: Why the request failed (its samples finish with ``"error"``); None otherwise.
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """The pooled vector of one prompt (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What the engine emits for an embedding request: one output, at the end (vLLM's
    ``EmbeddingRequestOutput``). ``outputs`` is None when the request was aborted or failed
    (``error`` says why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class ScoringOutput:
    """The similarity score of one pair of texts (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """One pair's score (vLLM's ``ScoringRequestOutput``): the cosine similarity of the two
    texts' embeddings."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True
