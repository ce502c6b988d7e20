"""LoRA adapters on the server: ``--lora-modules`` names them at start-up, a body's
``model`` picks one (serving.py ``check_model``), ``/v1/models`` lists them beside the
base model, and with ``--allow-runtime-lora-updating`` vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove them while the server runs."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from cadence.lora import LoRARequest
from cadence.lora.adapter import read_adapter
from cadence.server.protocol import RequestError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


LORA_BODIES = {"/v1/load_lora_adapter": LoadLoRAAdapterRequest,
               "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}


def parse_lora_modules(values: list[str]) -> list[LoRARequest]:
    """``--lora-modules`` entries, ``name=path`` or vLLM's JSON form ``{"name": ...,
    "path": ...}``, as LoRA requests numbered from 1; a ValueError naming a bad one."""
    out: list[LoRARequest] = []
    for i, value in enumerate(values, 1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs 'name' and "
                                 f"'path' ({e})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON "
                                 "object with 'name' and 'path'")
        if any(lr.lora_name == name for lr in out):
            raise ValueError(f"--lora-modules names {name!r} twice")
        out.append(LoRARequest(name, i, path))
    return out


def model_cards(serving: Any, max_model_len: int) -> list[dict]:
    """The /v1/models entries: the base model, then each adapter with its parent."""
    base = {"id": serving.model_name, "object": "model", "created": 0,
            "owned_by": "cadence", "root": serving.model_name, "parent": None,
            "max_model_len": max_model_len}
    return [base] + [{"id": name, "object": "model", "created": 0, "owned_by": "cadence",
                      "root": lr.lora_path, "parent": serving.model_name,
                      "max_model_len": max_model_len}
                     for name, lr in serving.loras.items()]


def install_lora_routes(app: FastAPI, serving: Any, model_dir: str, max_rank: int) -> None:
    """The two runtime routes (only with ``--allow-runtime-lora-updating``)."""
    ids = itertools.count(max((lr.lora_int_id for lr in serving.loras.values()), default=0)
                          + 1)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Any:
        for field in ("lora_name", "lora_path"):
            if not getattr(req, field):
                raise RequestError(f"{field} must be a non-empty string", field)
        if req.lora_name in serving.loras or req.lora_name == serving.model_name:
            raise RequestError(f"the adapter {req.lora_name!r} is already loaded; unload it "
                               "first", "lora_name")
        try:
            # Checked against the model now, off the event loop (it reads the files).
            await asyncio.get_running_loop().run_in_executor(
                None, read_adapter, req.lora_path, model_dir, max_rank)
        except (ValueError, OSError) as e:
            raise RequestError(str(e), "lora_path") from None
        if req.lora_name in serving.loras:  # another load of the name won the race
            raise RequestError(f"the adapter {req.lora_name!r} is already loaded; unload it "
                               "first", "lora_name")
        serving.loras[req.lora_name] = LoRARequest(req.lora_name, next(ids), req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Any:
        if serving.loras.pop(req.lora_name, None) is None:
            raise RequestError(f"the adapter {req.lora_name!r} is not loaded; loaded: "
                               f"{sorted(serving.loras)}", "lora_name", 404,
                               "model_not_found")
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
