"""``max_loras``: at most that many distinct adapters in the running batch, so one step
never needs more. No torch here."""

from __future__ import annotations

from cadence.request import Request


def lora_id(request: Request) -> int:
    """The request's adapter id, 0 for the base model."""
    lora = request.lora_request
    return 0 if lora is None else lora.lora_int_id


class LoRAAdmission:
    """The scheduler's admission rule for adapters (``cadence.scheduler.AdmissionRule``).

    A waiting request whose adapter is already running, or that runs the base model, is
    always admitted; one with another adapter only while fewer than ``max_loras`` run. The
    others wait and requests behind them may go first, as in vLLM; the running ones keep
    their adapters until they finish, so a turned-away adapter gets its turn."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._active: set[int] = set()

    def start(self, running: list[Request]) -> None:
        self._active = {i for i in map(lora_id, running) if i}

    def admits(self, request: Request) -> bool:
        i = lora_id(request)
        return not i or i in self._active or len(self._active) < self.max_loras

    def admitted(self, request: Request) -> None:
        i = lora_id(request)
        if i:
            self._active.add(i)
