"""The torch part shared by backends: load the model, own the KV cache, turn a ``ModelInput``
into tensors, run the forward inside the forward context, sample.

Backends compose it and decide *when* things run (their overlap strategy). Nothing here
names a device library; the device is a ``torch.device`` the backend passes in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadence.backend import ModelInput, SamplerOutput, SamplingMetadata
from cadence.config import EngineConfig
from cadence.forward_context import set_forward_context
from cadence.host_memory import anonymous_buffer
from cadence.layers import paged_attention, sampler
from cadence.layers.pooling import pooled_sums
from cadence.layers.prompt_logprobs import compute_prompt_logprobs

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class PreparedInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    sample_token_idx: torch.Tensor
    metadata: object
    # (token rows, target ids, top-k count) of the step's prompt logprobs, or None.
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, int] | None = None
    # (first row, row count) of each span whose hidden states to sum (embeddings).
    pool_rows: list[tuple[int, int]] | None = None
    # The step's LoRA adapters (cadence.lora.runtime.LoRAStep), or None.
    lora: object = None


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int,
               huge_pages: bool = False, purpose: str = "a buffer") -> list[torch.Tensor]:
    """``count`` zero-filled CPU tensors of ``shape``, backed by one anonymous memory mapping
    (on huge pages when ``huge_pages``: core/host_memory.py).

    NOTE the kernel maps a fresh anonymous page as zeros on first touch, so memory nobody has
    written yet costs nothing. ``torch.zeros`` writes every byte up front instead: for the CPU
    backend's default 2 GiB KV cache, measured at 1-3 s of each start-up, although a short
    request touches a few pages of it. Reads see zeros either way.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or count == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    flat = anonymous_buffer(nbytes * count, huge_pages, purpose)
    return [flat[i * nbytes:(i + 1) * nbytes].view(dtype).view(shape) for i in range(count)]


def prompt_logprob_tensors(mi: ModelInput, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``PreparedInput.prompt_logprobs`` of a step: None when it asks for none."""
    if not mi.prompt_logprob_rows:
        return None
    return (sampler.host_tensor(mi.prompt_logprob_rows, torch.int64, device),
            sampler.host_tensor(mi.prompt_logprob_targets, torch.int64, device),
            max(mi.num_prompt_logprobs, 0))


class ModelRunner:
    """Model + KV cache + input preparation + sampling on one torch device."""

    def __init__(self, config: EngineConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[config.model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.model = None
        self.hf_config = None
        self.attn = None
        # Wraps the model's projections and serves each step's adapters; None unless the
        # engine serves LoRA adapters.
        self.lora = None
        # Turns a ModelInput into the attention metadata ``self.attn`` expects; a backend
        # with its own attention sets its own.
        self.metadata_builder = paged_attention.build_metadata
        # The last step of random sampling (``sampler.draw_softmax``'s contract); a backend
        # with a kernel for it sets its own. None: the torch one.
        self.draw: sampler.Draw | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model_config.seed)
        # The prompt logprobs and pooled sums ``run_model`` computed, until ``sample`` hands
        # them on with the step's samples.
        self._prompt_logprobs: tuple | None = None
        self._pooled: torch.Tensor | None = None
        # Async scheduling: the sampled ids of the last step that completed (device tensor),
        # None while a step runs and after one failed, so that a step planned on them never
        # runs on stale ids. ``_previous`` is what the step now running reads.
        self.last_sampled: torch.Tensor | None = None
        self._previous: torch.Tensor | None = None

    def load_model(self, before_move: Callable[[torch.nn.Module], None] | None = None
                   ) -> None:
        """Load the model on the CPU and move it to the device. ``before_move`` runs on the
        CPU-loaded model first: a backend that keeps some weights in a form of its own
        drops the dense ones there, so they never take device memory."""
        from cadence.model_loader import load_model

        model, self.hf_config = load_model(self.config.model_config)
        if before_move is not None:
            before_move(model)
        self.model = model.to(self.device)
        if self.config.lora_config is not None:
            from cadence.lora.runtime import LoRAManager

            # Before a backend swaps the linears for its own GEMMs: it swaps the wrapped
            # ones' ``base`` and the wrappers stay.
            self.lora = LoRAManager(self.config, self.model, self.dtype, self.device)

    def kv_cache_spec(self) -> KVCacheSpec:
        m = self.model
        return KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, self.block_size, self.dtype)

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        spec = self.kv_cache_spec()
        needed = self._blocks_per_sequence()
        num_blocks = self.config.cache_config.num_blocks or num_bytes // spec.bytes_per_block
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than "
                f"one sequence of max_model_len={self.config.model_config.max_model_len} needs "
                f"({needed}); give it more memory or lower max_model_len"
            )
        return num_blocks

    def _blocks_per_sequence(self) -> int:
        """The most blocks one sequence holds at once. Under a sliding window on every layer
        that is the window plus the largest chunk, wherever the sequence ends: the blocks
        behind the window are freed as it runs (core/block_manager.py)."""
        bs = self.block_size
        tokens = self.config.model_config.max_model_len
        window = self.config.cache_config.sliding_window
        if window is not None:
            # Keys from c + 1 - W through c + chunk - 1, plus a partial block at each end.
            chunk = self.config.scheduler_config.max_num_batched_tokens
            return min(-(-tokens // bs), -(-(window - 1 + chunk) // bs) + 1)
        return -(-tokens // bs)

    def allocate_kv_cache(self, num_blocks: int, huge_pages: bool = False
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V caches; ``huge_pages``: on the CPU, on 2 MiB pages."""
        spec = self.kv_cache_spec()
        shape = (num_blocks * self.block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            tensors = lazy_zeros(shape, self.dtype, 2 * spec.num_layers, huge_pages,
                                 "the KV cache (on the cpu backend, ask for less: "
                                 "--cpu-kv-cache-gb or --num-kv-blocks)")
        else:
            tensors = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                       for _ in range(2 * spec.num_layers)]
        self.num_blocks = num_blocks
        return tensors[:spec.num_layers], tensors[spec.num_layers:]

    def prepare(self, mi: ModelInput, build_metadata=None) -> PreparedInput:
        build = build_metadata or self.metadata_builder
        input_ids = torch.tensor(mi.input_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(mi.positions, dtype=torch.int64, device=self.device)
        sample_idx = torch.tensor(mi.sampled_rows(), dtype=torch.int64, device=self.device)
        return PreparedInput(input_ids, positions, sample_idx,
                             build(mi, self.block_size, self.device),
                             prompt_logprob_tensors(mi, self.device), mi.pool_rows or None,
                             self.lora.step(mi) if self.lora is not None else None)

    @torch.inference_mode()
    def run_model(self, prepared: PreparedInput) -> torch.Tensor | None:
        """Forward + logits of the sampled rows ([num_sampled, vocab] float32); None on a
        pipeline stage before the last (it computes no logits). The step's prompt logprobs
        and pooled sums, if it asks for any, are computed here too, and ``sample`` returns
        them."""
        self._prompt_logprobs = self._pooled = None
        with set_forward_context(self.attn, prepared.metadata, prepared.lora):
            hidden = self.model(prepared.input_ids, prepared.positions)
        if hidden is None:
            return None
        if prepared.prompt_logprobs is not None:
            self._prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden,
                                                            *prepared.prompt_logprobs)
        if prepared.pool_rows:
            self._pooled = pooled_sums(hidden, prepared.pool_rows)
        if prepared.sample_token_idx.numel() == 0:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, prepared.sample_token_idx))

    def forward(self, mi: ModelInput) -> torch.Tensor:
        self._previous, self.last_sampled = self.last_sampled, None
        prepared = self.prepare(mi)
        if mi.placeholder_idx:
            self.fill_placeholders(prepared.input_ids, mi, self._previous)
        return self.run_model(prepared)

    @staticmethod
    def fill_placeholders(input_ids: torch.Tensor, mi: ModelInput,
                          previous: torch.Tensor | None) -> None:
        """Replace the placeholder input ids with the previous step's sampled ids, on the
        device: the host never waits for them (async scheduling)."""
        if previous is None:
            raise RuntimeError("a step planned on the previous step's samples runs after a "
                               "step that produced none (it failed): refusing stale token ids")
        dev = input_ids.device
        idx = sampler.host_tensor(mi.placeholder_idx, torch.int64, dev)
        src = sampler.host_tensor(mi.placeholder_src, torch.int64, dev)
        input_ids.index_copy_(0, idx, previous.index_select(0, src))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, meta: SamplingMetadata
               ) -> sampler.DeviceSample:
        if logits is None or logits.shape[0] == 0:
            out = sampler.DeviceSample(torch.empty(0, dtype=torch.int64))
        else:
            pending = sampler.pending_output_ids(meta, self._previous, logits.shape[1])
            out = sampler.sample(logits.float(), meta, self.generator, pending, self.draw)
        self.attach_prompt_outputs(out)
        self.last_sampled = out.token_ids
        return out

    def take_prompt_logprobs(self) -> tuple | None:
        """The prompt logprobs the last ``run_model`` computed (once). Kept for backends
        written before embeddings; ``attach_prompt_outputs`` also hands on pooled sums."""
        out, self._prompt_logprobs = self._prompt_logprobs, None
        return out

    def attach_prompt_outputs(self, out: sampler.DeviceSample) -> sampler.DeviceSample:
        """Hand the prompt logprobs and pooled sums the last ``run_model`` computed on in
        ``out`` (once), for a backend that samples without ``sample``; pass a throwaway
        ``DeviceSample`` to drop a failed step's."""
        out.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        out.pooled, self._pooled = self._pooled, None
        return out

    def to_host(self, sampled: sampler.DeviceSample) -> SamplerOutput:
        return sampler.to_host(sampled)
