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

    A waiting request for the base model is always admitted; one for an adapter while its
    adapter runs or fewer than ``max_loras`` do. Once a request is turned away, no adapter
    request behind it is admitted in that step, not even for a running adapter: otherwise
    steady traffic for the running adapters would keep the turned-away one waiting for
    ever (vLLM admits them). The running adapters then drain, and it gets its turn; the base
    model's requests go ahead meanwhile."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._active: set[int] = set()
        self._closed = False

    def start(self, running: list[Request]) -> None:
        self._active = {i for i in map(lora_id, running) if i}
        self._closed = False

    def admits(self, request: Request) -> bool:
        i = lora_id(request)
        if not i:
            return True
        if self._closed or (i not in self._active and len(self._active) >= self.max_loras):
            self._closed = True
            return False
        return True

    def admitted(self, request: Request) -> None:
        i = lora_id(request)
        if i:
            self._active.add(i)


def adapter_names(requests: list[Request]) -> tuple[str, ...]:
    """The names of the adapters ``requests`` run with, sorted, each once."""
    return tuple(sorted({r.lora_request.lora_name for r in requests
                         if r.lora_request is not None and not r.is_finished}))
