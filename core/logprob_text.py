"""What a logprob entry says: each token's log-probability, rank and text, in vLLM's shape
(``{token id: Logprob}``, the chosen token first). No torch here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cadence.detokenizer import complete_partial_token, token_text_decoder
from cadence.outputs import Logprob


class LogprobFormatter:
    """Builds logprob entries from the sampler's raw (logprob, rank, top ids, top logprobs)
    rows, with each token's text as vLLM writes it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # One token's text, for logprobs: with top-k logprobs every sampled token asks for
        # k + 1 of them, and the tokenizer's ``decode`` costs ~40 us a call in Python
        # wrappers; the vocabulary is finite.
        self._token_text: dict[int, str | None] = {}
        self._decode_text = None if tokenizer is None else token_text_decoder(tokenizer)

    def entry(self, token: int, lp: tuple, detokenize: bool = True,
              context: Sequence[int] = ()) -> dict[int, Logprob]:
        """One position's logprobs; ``context``: the tokens before it (at most four), which
        complete the text of a token holding part of a character."""
        sampled_lp, rank, top_ids, top_lps = lp
        # detokenize=False asks for no text at all: decoded_token None, as in vLLM.
        text, decode = (self._token_text, self._decode_one) if detokenize else ({}, _no_text)
        # vLLM's order: the chosen token first, then the top k by rank; one of them, it keeps
        # its place and takes the top-k entry (the same logprob, its rank among the k).
        d = {token: Logprob(sampled_lp, rank, text[token] if token in text else
                            decode(token))}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_lps)):
            d[tid] = Logprob(tlp, r + 1, text[tid] if tid in text else decode(tid))
        if detokenize and self.tokenizer is not None:
            context_open: bool | None = None
            for tid, e in d.items():
                if e.decoded_token is None or not e.decoded_token.endswith("\ufffd"):
                    continue
                # Part of a character: the text it completes after the tokens before it, or
                # "" (vLLM's), never the replacement character. Where the tokens before end
                # on a whole character there is nothing to complete, and one decode says so
                # for every such entry of the position (logprobs=-1 has thousands).
                if context_open is None:
                    context_open = bool(context) and \
                        self.tokenizer.decode(list(context)).endswith("\ufffd")
                e.decoded_token = complete_partial_token(self.tokenizer, tid, list(context)) \
                    if context_open else ""
        return d

    def prompt(self, prompt_ids: list[int], rows: list[tuple], k: int, detokenize: bool
               ) -> list[dict[int, Logprob] | None]:
        """A prompt's logprobs: None for the first token, then each one's entry with its
        ``k`` most likely (a step returns as many top entries for every row as its most
        demanding request asked for)."""
        return [None] + [
            self.entry(token, (lp, rank, ids[:k], lps[:k]), detokenize,
                       prompt_ids[max(0, j - 3):j + 1])
            for j, (token, (lp, rank, ids, lps)) in enumerate(zip(prompt_ids[1:], rows))]

    def _decode_one(self, token: int) -> str | None:
        text = None if self._decode_text is None else self._decode_text(token)
        self._token_text[token] = text
        return text


def _no_text(token: int) -> None:
    return None
