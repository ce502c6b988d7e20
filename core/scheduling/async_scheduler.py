"""The scheduler of async scheduling: the same rule, planned one step ahead. No torch here.

When ``schedule()`` runs, the previous step is still in flight: its tokens are counted as
placeholders (``Request.num_output_placeholders``), so a request whose last step samples is
planned as a decode of its placeholder, exactly as it would be once the token arrives.
"""

from __future__ import annotations

from cadence.request import Request
from cadence.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """``Scheduler`` that does not plan a step whose token is known to be discarded.

    A request whose placeholder is its ``max_tokens``-th output token, or reaches
    ``max_model_len``, finishes when that token is committed whatever it turns out to be: it
    is left out now (vLLM's async scheduler does the same), so a length limit costs no extra
    step and no extra block. EOS, stop ids and stop strings depend on the token's value: such
    a request is planned once more and that step's token is discarded at commit.
    """

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_output_placeholders and self._finishes_on_length(request):
            return 0
        return super()._num_new_tokens(request, budget)

    def _finishes_on_length(self, request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        num_out = len(request.output_token_ids) + request.num_output_placeholders
        return (max_tokens is not None and num_out >= max_tokens) or \
            request.num_tokens >= self.config.max_model_len
