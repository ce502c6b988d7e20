"""cadence: an LLM inference engine with an asynchronous output processor.

``import cadence`` stays light (no torch): backends may need to set environment variables
before torch loads. The heavy names are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cadence.beam_search import BeamSearchParams
from cadence.hookspecs import hookimpl
from cadence.lora.request import LoRARequest
from cadence.pooling.params import PoolingParams
from cadence.sampling_params import OutputKind, SamplingParams
from cadence.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "OutputKind", "PoolingParams", "BeamSearchParams",
           "StructuredOutputsParams", "LoRARequest",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput",
           "LLMEngine", "EngineArgs", "hookimpl", "__version__"]

_LAZY = {
    "LLM": "cadence.llm",
    "AsyncLLM": "cadence.async_engine",
    "LLMEngine": "cadence.engine",
    "EngineArgs": "cadence.engine_args",
    "RequestOutput": "cadence.outputs",
    "CompletionOutput": "cadence.outputs",
    "EmbeddingRequestOutput": "cadence.outputs",
    "EmbeddingOutput": "cadence.outputs",
}

if TYPE_CHECKING:
    from cadence.async_engine import AsyncLLM
    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs
    from cadence.llm import LLM
    from cadence.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cadence' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
