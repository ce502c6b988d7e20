"""The engine's side of structured output: admission after compilation, the grammar of each
sample advanced at commit, and the bitmask of each step. No torch; xgrammar lazily.

NOTE the states of a constrained request:
- ``add_request`` parses the constraint (a bad one is a ValueError, nothing queued) and
  hands the request's samples to ``hold``: they wait here, not in the scheduler, while the
  grammar compiles on a worker thread (vLLM's WAITING_FOR_FSM), so a slow schema never
  stalls the step loop. ``admit`` (each step, before scheduling) gives every sample of a
  compiled request its own matcher and passes it to the scheduler; a grammar that fails
  to compile fails that request alone.
- commit feeds each sampled token to the sample's matcher (``OutputProcessor.commit``); a
  matcher that terminates finishes the request with ``stop``.
- preemption by recompute keeps every output token (only their K/V are recomputed), so
  the matcher, which has seen exactly the committed tokens, stays valid: nothing to roll
  back. A stop string truncates tokens only of a request it finishes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.structured_output.bitmask import GrammarBitmask

# The longest the engine waits for a grammar at once when nothing else can run; it asks
# again on its next step, after taking the commands that arrived.
BLOCK_S = 0.25


class StructuredOutputManager:
    """Owns the engine's grammar compiler (built on first use) and the requests waiting for
    their grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._waiting: list[tuple[concurrent.futures.Future, list[Request]]] = []

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            from cadence.structured_output.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             self.stop_token_ids)
        return self._compiler

    def check(self, params: SamplingParams) -> None:
        """ValueError if the request's constraint cannot be parsed (nothing is queued)."""
        if params.structured_outputs is not None:
            self.compiler.validate(params.structured_outputs)

    def hold(self, samples: list[Request]) -> None:
        """Keep a request's samples until their grammar is compiled."""
        so = samples[0].sampling_params.structured_outputs
        self._waiting.append((self.compiler.submit(so), samples))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def holds(self, request_id: str) -> bool:
        """Whether a sample of that id waits here for its grammar (not yet scheduled)."""
        return any(s.request_id == request_id for _, samples in self._waiting
                   for s in samples if not s.is_finished)

    def admit(self, add: Callable[[Request], None], fail: Callable[[str, str], None],
              block: bool) -> None:
        """Pass the samples whose grammar is ready to ``add`` (the scheduler), each with its
        own matcher; ``fail(parent_id, message)`` those whose grammar did not compile.
        ``block``: wait for at least one grammar (nothing else can run meanwhile)."""
        # Aborted while their grammar compiled: nothing to wait for.
        self._waiting = [(f, s) for f, s in self._waiting if not any(x.is_finished for x in s)]
        if not self._waiting:
            return
        if block:
            # Bounded: a grammar that compiles for long must not keep the engine thread from
            # its commands (an abort of that very request, a shutdown) meanwhile.
            concurrent.futures.wait([f for f, _ in self._waiting], timeout=BLOCK_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        still = []
        for fut, samples in self._waiting:
            if not fut.done():
                still.append((fut, samples))
                continue
            try:
                compiled = fut.result()
            except Exception as e:  # noqa: BLE001  # that request's grammar alone failed
                fail(samples[0].parent_id, str(e))
                continue
            for s in samples:
                s.grammar = self.compiler.matcher(compiled)
                add(s)
        self._waiting = still

    def bitmask_for(self, sampled: list[Request]) -> GrammarBitmask | None:
        """The handle for one step's sampled rows, or None when none is constrained."""
        rows = [i for i, r in enumerate(sampled) if r.grammar is not None]
        if not rows:
            return None
        reqs = [sampled[i] for i in rows]
        width = (self.vocab_size + 31) // 32
        return GrammarBitmask(rows, lambda: fill_bitmask(reqs, width))

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


def fill_bitmask(reqs: list[Request], width: int) -> Any:
    """Each request's next-token bitmask, from its matcher's state (= its committed
    tokens). A request finished since the step was built gets every token: its sample is
    dropped at commit."""
    import numpy as np

    bitmask = np.zeros((len(reqs), width), dtype=np.int32)
    for i, req in enumerate(reqs):
        m = req.grammar
        if req.is_finished or m.is_terminated():
            bitmask[i] = -1
        else:
            m.fill_next_token_bitmask(bitmask, i)
    return bitmask


def advance(req: Request, token: int) -> bool:
    """Feed a committed token to the request's matcher; False if the grammar refused it."""
    m = req.grammar
    return m.is_terminated() or m.accept_token(token)
