"""How many adapters the engine serves and how large they may be. No torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras``: the most distinct adapters in one step (vLLM's name and meaning);
    requests for others wait. ``max_lora_rank``: the largest rank accepted. ``max_cpu_loras``:
    how many adapters the model side keeps loaded, least recently used dropped first (None:
    ``max_loras``; never fewer)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {cpu!r}")

    @property
    def num_resident(self) -> int:
        """How many adapters the model side keeps loaded at most."""
        return self.max_cpu_loras or self.max_loras
