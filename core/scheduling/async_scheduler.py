"""The scheduler of async scheduling: the same rule, planned one step ahead. No torch here.

When ``schedule()`` runs, the previous step is still in flight: its tokens are counted as
placeholders (``Request.num_output_placeholders``), so a request whose last step samples is
planned as a decode of its placeholder, exactly as it would be once the token arrives.
"""

from __future__ import annotations

from cadence.request import Request
from cadence.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """``Scheduler`` that plans around the step in flight.

    A request whose placeholder is its ``max_tokens``-th output token, or reaches
    ``max_model_len``, finishes when that token is committed whatever it turns out to be: it
    is left out now (vLLM's async scheduler does the same), so a length limit costs no extra
    step and no extra block. EOS, stop ids and stop strings depend on the token's value: such
    a request is planned once more and that step's token is discarded at commit.

    Structured output: a constrained request with a placeholder is left out too. Its next
    bitmask depends on the token in flight, so it runs every other step while the others run
    every step (docs/structured_output.md).

    NOTE sliding windows: the blocks that fall behind the window in the step in flight are
    freed when it is committed (``BlockManager.cache_full_blocks``), after this plan. A
    running request that fits once they are free waits for them instead of preempting:
    with a cache sized for one sequence, preempting would free and recompute the same
    request at every step, forever. Nothing else is admitted meanwhile.
    """

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_output_placeholders and (
                request.grammar is not None or self._finishes_on_length(request)):
            # Structured output: the grammar bitmask of the next token needs this one on
            # the host, so the request sits out the step planned while it is in flight.
            return 0
        return super()._num_new_tokens(request, budget)

    def _finishes_on_length(self, request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        num_out = len(request.output_token_ids) + request.num_output_placeholders
        return (max_tokens is not None and num_out >= max_tokens) or \
            request.num_tokens >= self.config.max_model_len

    def _preemption_victim(self, request: Request, num_new: int) -> Request | None:
        bm = self.block_manager
        if bm.can_allocate(request, num_new, bm.num_freeable_behind_window(self.running)):
            return None  # the step in flight frees enough behind the window
        return super()._preemption_victim(request, num_new)
