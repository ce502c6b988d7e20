"""Which of a step's sampled rows a request keeps. No torch here."""

from __future__ import annotations

from collections.abc import Callable


def accept_drafts(sampled: list[int], drafts: list[int],
                  take: Callable[[int, int], bool]) -> int:
    """Feed ``take(row, token)`` the sampled tokens of one request's rows in order (row j
    was computed with ``drafts[:j]`` appended), while each equals the draft the next row
    assumed; ``take`` returns True when the token ended the request. Returns how many
    drafts were kept: the request gains that many tokens plus one.

    Row j's token is the model's own choice after the tokens before it, so stopping at the
    first row whose token differs from its draft (that token is kept, the rows after it
    were computed on a token the request does not have) is exact for greedy and, with
    point-mass drafts, rejection sampling for random sampling."""
    last = len(drafts)
    for j, token in enumerate(sampled):
        if take(j, token) or j == last or token != drafts[j]:
            return j
    return last
