"""Speculative decoding: several tokens per step for a running request, verified against
the model in one forward. No torch here.

The data flow: before the scheduler plans a running decode, the ``Speculator``
(speculator.py) asks the proposer (ngram.py) for up to ``num_speculative_tokens`` draft
tokens; the step computes the decode's token and its drafts as one chunk, and the backend
samples every row of that chunk (``ModelInput.sampled_rows()``). Commit
(``accept_drafts``, acceptance.py) keeps the sampled tokens while each one equals the
draft it was computed on, plus the first one that does not, so a request gains 1 to
``k + 1`` tokens per step. The scheduler then counts only the accepted rows' K/V as
computed (``ScheduledRequest.num_accepted``).

Why the outputs are the tokens the engine gives without speculation: every sampled row is
the ordinary sampling of its position given the tokens before it (its penalties and min_tokens
count the drafts before it, its seeded draw is keyed by its output index), and a draft is
only kept when the sampled token equals it. With a point-mass draft, that is rejection
sampling exactly: P(keep) = p(draft), and a rejected row's token is p's draw conditioned on
not being the draft. With rows whose bits do not depend on the batch (the CPU backend),
greedy and seeded sampling give the same tokens and logprobs with speculation on or off
(docs/speculative_decoding.md).
"""

from cadence.spec_decode.acceptance import accept_drafts
from cadence.spec_decode.config import SpeculativeConfig
from cadence.spec_decode.ngram import NgramProposer
from cadence.spec_decode.speculator import Speculator

__all__ = ["NgramProposer", "SpeculativeConfig", "Speculator", "accept_drafts"]
