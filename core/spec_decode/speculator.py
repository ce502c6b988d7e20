"""The scheduler's speculation strategy: which running requests get drafts, and how many.
No torch here."""

from __future__ import annotations

from cadence.request import Request
from cadence.spec_decode.config import SpeculativeConfig
from cadence.spec_decode.ngram import NgramIndex, NgramProposer

# A request whose drafts are mostly turned down stops drafting, but for one draft every
# _PROBE_EVERY steps, which brings it back when its output starts to repeat. Turned-down
# drafts cost rows: on a 2-core CPU at batch 64, random prompts sampled at temperature 1
# (4 % of drafts kept) ran at 0.83x without drafts (docs/performance.md).
_LOW_RATE = 0.25
_PROBE_EVERY = 8
_SMOOTHING = 0.3  # weight of the latest step in the running acceptance rate


class SpecState:
    """One request's proposer index and how its drafts fared."""

    __slots__ = ("index", "rate", "skipped")

    def __init__(self) -> None:
        self.index: NgramIndex | None = None
        self.rate = 1.0  # start as a fixed-k proposer would, and learn
        self.skipped = 0


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
        state = request.spec_state
        if state is None:
            state = request.spec_state = SpecState()
        if state.rate < _LOW_RATE:
            state.skipped += 1
            if state.skipped < _PROBE_EVERY:
                return []
            state.skipped, k = 0, 1
        drafts, state.index = self.proposer.propose(request.all_token_ids, state.index, k)
        return drafts

    @staticmethod
    def observe(request: Request, num_drafts: int, num_kept: int) -> None:
        """A committed step ran ``num_drafts`` of ``request``'s drafts and kept
        ``num_kept``: fold that into its running rate."""
        state = request.spec_state
        if state is not None and num_drafts:
            state.rate += _SMOOTHING * (num_kept / num_drafts - state.rate)
