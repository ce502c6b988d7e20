"""The engine's adapters: each ``lora_int_id`` checked once against the model, then known
by its id. No torch here."""

from __future__ import annotations

import dataclasses
import os

from cadence.lora.adapter import AdapterSpec, read_adapter
from cadence.lora.config import LoRAConfig
from cadence.lora.request import LoRARequest
from cadence.sampling_params import FieldError


class LoRARegistry:
    """Adapters the engine has checked, by ``lora_int_id``. A request's adapter is checked
    the first time its id is seen (a ValueError for the caller, nothing queued), so a step
    never meets an adapter that cannot load."""

    def __init__(self, config: LoRAConfig | None, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self._known: dict[int, tuple[LoRARequest, AdapterSpec]] = {}

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def check(self, request: object) -> LoRARequest:
        """``request`` (a ``LoRARequest``) with its folder as an absolute path, once the
        folder was checked against the model; a ``FieldError`` naming ``lora_request``
        otherwise. The path travels to every rank and worker, whatever their directory."""
        if not isinstance(request, LoRARequest):
            raise FieldError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}", "lora_request")
        if self.config is None:
            raise FieldError("this engine was started without LoRA (enable_lora=True / "
                             "--enable-lora serves adapters)", "lora_request")
        path = os.path.abspath(request.lora_path)
        known = self._known.get(request.lora_int_id)
        if known is not None:
            if known[1].path != path:
                raise FieldError(f"lora_int_id {request.lora_int_id} is already the adapter "
                                 f"{known[0].lora_name!r} at {known[0].lora_path!r}; one id "
                                 "names one folder", "lora_request")
            return dataclasses.replace(request, lora_path=path)
        try:
            spec = read_adapter(path, self.model_dir, self.config.max_lora_rank)
        except ValueError as e:
            raise FieldError(str(e), "lora_request") from e
        except Exception as e:  # a malformed file of any kind is the caller's
            raise FieldError(f"LoRA adapter {request.lora_path!r} could not be read: "
                             f"{type(e).__name__}: {e}", "lora_request") from e
        self._known[request.lora_int_id] = (request, spec)
        return dataclasses.replace(request, lora_path=path)

    def add(self, request: LoRARequest) -> bool:
        """Check and remember an adapter ahead of its requests (vLLM's ``add_lora``)."""
        self.check(request)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already queued with it keep it, and the id may then
        name another folder (its prefix-cache blocks stay apart: the namespace is the id
        and the folder). False if unknown."""
        return self._known.pop(lora_int_id, None) is not None

    def list(self) -> list[LoRARequest]:
        return [req for req, _ in self._known.values()]
