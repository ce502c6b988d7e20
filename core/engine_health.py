"""What the engine does when its backend fails or a step is interrupted: fail every request
with the reason, plan a restart, reset the KV cache the restarted backend comes back with,
and drop steps in flight after an interrupt. The policy (how many restarts, what counts as
lost) is ``StepGuard``'s (core/faults.py); this is the engine's side of it.
"""

from __future__ import annotations

import logging

from cadence.outputs import RequestOutput

# The engine's logger: these lines are the engine's to whoever filters its log.
logger = logging.getLogger("cadence.engine")


class EngineHealth:
    """``LLMEngine``'s recovery methods (a mixin: they use its guard, step loop, output
    processor and block manager)."""

    def _fail_all(self, message: str) -> None:
        if self._loop is not None:
            self._loop.discard()  # the device state those steps ran on is gone
        self._drain()
        self.output_processor.fail_all(message)

    def _reset_kv(self, num_blocks: int) -> None:
        # The restarted backend's cache holds nothing: every block, cached prefixes included,
        # starts free. Every request was failed first, so none still holds one.
        cc = self.config.cache_config
        self.block_manager.reset(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache reset: %d blocks of %d tokens", num_blocks, cc.block_size)

    def check_health(self) -> list[RequestOutput]:
        """Between steps: ask the backend whether its worker lives. If it was lost, every
        request ends with an error (their final outputs are returned) and a restart is
        planned for ``repair()`` or the next ``step()``; raises ``EngineFailedError`` when
        it may not be restarted."""
        self.guard.check_health()
        return self.output_processor.take_ready()

    def after_interrupt(self) -> list[RequestOutput]:
        """Call when a ``KeyboardInterrupt`` (or another ``BaseException`` that is not an
        ``Exception``) has left ``step()``, after aborting the requests it was running that
        the caller no longer wants (``LLM`` aborts its call's). The steps still in flight
        are dropped (``Backend.discard_in_flight``): their samples would otherwise be read
        as a later step's; the engine takes back its advance of them, so a request kept
        computes those tokens again. A backend that stopped its
        worker because the interrupt cut their exchange short is restarted before the next
        step runs, rather than failing its requests (``StepGuard.after_interrupt``).
        Returns the final outputs of the requests that ended."""
        try:
            self.guard.after_interrupt(self._loop)
        finally:
            ended = self.output_processor.take_ready()
        return ended

    def repair(self) -> None:
        """Restart a lost backend now, if one is waiting for it (``step`` does it too)."""
        self.guard.repair()
