"""What the scheduler hands the engine for one step: each request's share of the step
(``ScheduledRequest``) and the step as a whole (``StepPlan``), plus the error for a request
that can never fit the KV cache. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.request import Request


class RequestTooLargeError(RuntimeError):
    """A request needs more KV blocks than the whole cache has: it can never run."""

    def __init__(self, request: Request, message: str) -> None:
        super().__init__(message)
        self.request = request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` from ``num_computed_tokens`` on.

    ``samples`` and ``is_decode`` are fixed when the entry is built, so they stay right after
    the engine appends the sampled token and ``update_after_step`` advances the request.
    ``spec_token_ids``: draft tokens computed after the request's own (speculative decoding,
    cadence/spec_decode), counted in ``num_new_tokens``; commit sets ``num_accepted``, how
    many of them were kept, and only those count as computed.
    """

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    num_accepted: int = field(default=0, init=False)
    samples: bool = field(init=False)
    is_decode: bool = field(init=False)
    # Pipeline parallel counts an entry's tokens as computed when it is submitted; this is
    # the request's count before that (-1: counted at commit, as everywhere else).
    counted_from: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        end = self.request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
        # The chunk reaches the last token, so its logits are sampled.
        self.samples = end == self.request.num_tokens
        self.is_decode = self.samples and self.num_new_tokens == 1


@dataclass(slots=True)
class StepPlan:
    """What one step computes: decodes first, then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
