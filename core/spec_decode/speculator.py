"""The scheduler's speculation strategy: which running requests get drafts, and how many.
No torch here."""

from __future__ import annotations

from cadence.request import Request
from cadence.spec_decode.config import SpeculativeConfig
from cadence.spec_decode.ngram import NgramProposer


class Speculator:
    """Proposes drafts for a running request about to decode (``Scheduler.speculator``).

    Requests whose next token depends on more than the model and their own tokens get
    none: a grammar (its matcher would have to follow the drafts), bad words (banned by
    the token before), pooling; so do requests with a token still in flight."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def drafts(self, request: Request, most: int) -> list[int]:
        """Up to ``num_speculative_tokens`` drafts for ``request``'s next step, and at most
        ``most`` (what the step's token budget leaves); [] for none."""
        if request.num_tokens - request.num_computed_tokens != 1 or \
                request.num_output_placeholders or request.grammar is not None or \
                request.bad_words_ids or request.pooling is not None:
            return []
        sp = request.sampling_params
        k = min(self.config.num_speculative_tokens, most,
                # The step gains at most k + 1 tokens; drafts past max_tokens or the
                # context would be computed only to be dropped.
                self.max_model_len - request.num_tokens - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - len(request.output_token_ids) - 1)
        if k <= 0:
            return []
        drafts, request.spec_state = self.proposer.propose(
            request.all_token_ids, request.spec_state, k)
        return drafts
