"""The host side of one embedding request: which prompt rows to pool, their sums as the
chunks of the prompt arrive, and the vector they make. No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cadence.pooling.config import PoolerConfig


@dataclass(slots=True)
class PoolingState:
    """Pooling progress of one request over its ``num_prompt_tokens`` prompt positions."""

    pooling_type: str
    normalize: bool
    dimensions: int | None
    num_prompt_tokens: int
    # (first position, number of positions, their summed hidden states) per span computed.
    # Keyed by position, not appended blindly: a preempted prompt computed again sends its
    # spans again, and they replace the earlier ones instead of being counted twice.
    spans: list[tuple[int, int, list[float]]] = field(default_factory=list)

    @classmethod
    def create(cls, pooler: PoolerConfig, normalize: bool | None, dimensions: int | None,
               num_prompt_tokens: int) -> PoolingState:
        return cls(pooler.pooling_type, pooler.normalize if normalize is None else normalize,
                   dimensions, num_prompt_tokens)

    @property
    def needs_every_row(self) -> bool:
        """Whether rows a prefix-cache hit would skip are read (all but the last)."""
        return self.pooling_type != "last"

    def wanted(self, start: int, end: int) -> tuple[int, int] | None:
        """The (first position, count) of prompt positions ``[start, end)`` that pooling
        reads, or None."""
        n = self.num_prompt_tokens
        if self.pooling_type == "last":
            return (n - 1, 1) if start <= n - 1 < end else None
        if self.pooling_type == "cls":
            return (0, 1) if start == 0 < end else None
        stop = min(end, n)
        return (start, stop - start) if start < stop else None

    def add(self, first: int, count: int, sums: list[float]) -> None:
        # A prompt computed again after a preemption starts from an earlier position.
        self.spans = [s for s in self.spans if s[0] < first]
        self.spans.append((first, count, sums))

    @property
    def is_complete(self) -> bool:
        needed = self.num_prompt_tokens if self.pooling_type == "mean" else 1
        return sum(c for _, c, _ in self.spans) == needed

    def embedding(self) -> list[float]:
        """The pooled vector: mean or single row, cut to ``dimensions``, then normalized."""
        if not self.is_complete:
            raise RuntimeError("the embedding of a prompt not yet computed in full")
        total = [math.fsum(col) for col in zip(*(s for _, _, s in self.spans))]
        count = sum(c for _, c, _ in self.spans)
        vec = [v / count for v in total] if count > 1 else total
        if self.dimensions is not None:
            vec = vec[:self.dimensions]
        if self.normalize:
            # torch.nn.functional.normalize's eps: a zero vector stays zero.
            norm = max(math.sqrt(math.fsum(v * v for v in vec)), 1e-12)
            vec = [v / norm for v in vec]
        return vec
