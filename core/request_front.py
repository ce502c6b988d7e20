"""What every asyncio front end offers on top of its ``add_request``: ``AsyncLLM`` and the
data-parallel replicas share it, so a request kind added here reaches both. No torch."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence

from cadence.beam_search import BeamSearchOutput, BeamSearchParams
from cadence.lora import LoRARequest
from cadence.output_state import OutputKind
from cadence.outputs import EmbeddingRequestOutput, RequestOutput
from cadence.pooling import PoolingParams
from cadence.sampling_params import SamplingParams


def request_ids(request_id: str | Iterable[str]) -> list[str]:
    """An ``abort`` argument as a list: one id, or several (vLLM's ``AsyncLLM.abort`` takes
    both)."""
    if isinstance(request_id, str):
        return [request_id]
    if not isinstance(request_id, Iterable):
        raise ValueError(f"request_id must be a string or an iterable of strings, got "
                         f"{type(request_id).__name__}")
    ids = list(request_id)
    bad = next((r for r in ids if not isinstance(r, str)), None)
    if bad is not None:
        raise ValueError(f"request ids must be strings, got {type(bad).__name__}")
    return ids


class RequestFront:
    """Mixed into a front end that has ``add_request``, ``tokenizer``, ``eos_token_ids``
    and ``max_model_len``."""

    async def generate(self, prompt: str | Sequence[int] | dict,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       output_kind: OutputKind | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs as they become ready: each with
        everything so far unless ``output_kind`` (or the params' ``output_kind``) says
        ``DELTA`` or ``FINAL_ONLY`` (vLLM's default and field). The arguments are named as
        vLLM's ``AsyncLLM.generate`` names them; ``sampling_params=None`` takes the model's
        generation defaults."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority,
                                        output_kind, lora_request)
        async for out in stream:
            yield out

    async def encode(self, prompt: str | Sequence[int] | dict,
                     pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[EmbeddingRequestOutput]:
        """Queue one embedding request and yield its one output (vLLM's ``encode``)."""
        stream = await self.add_request(prompt, pooling_params or PoolingParams(), request_id,
                                        priority, OutputKind.FINAL_ONLY, lora_request)
        async for out in stream:
            yield out

    async def beam_search(self, prompt: str | Sequence[int] | dict, params: BeamSearchParams,
                          priority: int = 0, lora_request: LoRARequest | None = None
                          ) -> BeamSearchOutput:
        """Beam search for one prompt (vLLM's ``beam_search``; core/beam_search.py): its
        beams best first, each round's requests through this front end."""
        from cadence.beam_search import beam_search_async, detokenizer
        from cadence.request_intake import tokenize_prompt

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        (out,) = await beam_search_async(self, [tokenize_prompt(self.tokenizer, prompt)[1]],
                                         params, self.eos_token_ids, self.max_model_len,
                                         detokenizer(self.tokenizer), priority, lora_request)
        return out
