"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the
n-gram that ends a request's tokens, continued periodically where that occurrence overlaps
the end. No torch here.

Each request keeps an index from n-gram to where its latest occurrence ends, grown by the
tokens added since the last proposal, so a proposal costs O(new tokens x n-gram sizes)
instead of a scan over the whole history every step.
"""

from __future__ import annotations


class NgramIndex:
    """One request's n-grams of ``low``..``high`` tokens -> end index of the latest
    occurrence, over ``tokens[:indexed]``."""

    __slots__ = ("high", "indexed", "latest", "low")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.indexed = 0
        self.latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the occurrences that end at ``indexed`` .. ``upto - 1``."""
        latest, low, high = self.latest, self.low, self.high
        for end in range(self.indexed, upto):
            for n in range(low, min(high, end + 1) + 1):
                latest[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer:
    """Drafts for one request from its own prompt and output (vLLM's ``ngram`` method)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.low, self.high = prompt_lookup_min, prompt_lookup_max

    def propose(self, tokens: list[int], state: NgramIndex | None, k: int
                ) -> tuple[list[int], NgramIndex]:
        """Up to ``k`` drafts to follow ``tokens``, longest match first, and the request's
        index (``state``, made on first use) to pass back next time."""
        if state is None or state.indexed > len(tokens):
            state = NgramIndex(self.low, self.high)  # new, or its tokens were cut back
        last = len(tokens) - 1
        # Occurrences ending before the last token: the suffix itself is not a match.
        state.extend(tokens, last)
        latest = state.latest
        for n in range(min(self.high, last), self.low - 1, -1):
            end = latest.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return _continuation(tokens, end, last, k), state
        return [], state


def _continuation(tokens: list[int], end: int, last: int, k: int) -> list[int]:
    """The ``k`` tokens that follow a match ending at ``end`` when the same n-gram ends at
    ``last``. Past ``last`` the match's continuation is the drafts themselves: the tokens
    repeat with period ``last - end``. A loop of one token ("a a a") then gets ``k`` drafts,
    not the one token between the two occurrences."""
    period = last - end
    out = tokens[end + 1:end + 1 + min(k, period)]
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
