"""Which adapter a request runs with. No torch here."""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter for a request, as vLLM names it: ``lora_name`` (what the server's
    ``model`` field says), ``lora_int_id`` (>= 1, the engine's key for it: one id, one
    folder) and ``lora_path`` (a PEFT folder: ``adapter_config.json`` and
    ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        i = self.lora_int_id
        if not isinstance(i, numbers.Integral) or isinstance(i, bool) or i < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {i!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a folder path, got {self.lora_path!r}")
