"""Attention of the CUDA backend: Triton kernels for the KV write and decode, torch SDPA for
prefill chunks, and the metadata built from the staged (device-side) step inputs.

The cache layout is the core's flat-slot layout (``cadence.layers.paged_attention``), so the
torch reference there is the oracle for the kernels and for the prefill here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from cadence.backend import ModelInput
from cadence.backends.cuda.buffers import StagedViews
from cadence.layers.paged_attention import PrefillSeq, run_prefills
from cadence.layers.prefill_batch import FreshPrefillBatch, plan_fresh_batches


@dataclass(slots=True)
class CudaAttentionMetadata:
    """Device tensors the attention layers need for one step (decodes first)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (not written)
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, W] block ids of the decode rows
    seq_lens: torch.Tensor | None  # [num_decodes] tokens in the cache, this one included
    prefills: list[PrefillSeq]
    # Fresh prompts grouped to run in one attention call per layer (prefill_batch.py).
    fresh_batches: list[FreshPrefillBatch] = field(default_factory=list)


def sample_token_indices(query_lens: list[int], sample_seq_indices: list[int]) -> list[int]:
    """Flat token index of the last query token of each sampled sequence."""
    ends, total = [], 0
    for q in query_lens:
        total += q
        ends.append(total - 1)
    return [ends[i] for i in sample_seq_indices]


def build_metadata(mi: ModelInput, views: StagedViews, block_size: int) -> CudaAttentionMetadata:
    """Metadata from the staged device views; only index arithmetic on the device, no copy.

    A prefill chunk with cached context gathers its whole context from the cache; its slot
    ids are computed on the device from its block-table row (``arange`` has no host sync).
    """
    nd = mi.num_decodes
    prefills = []
    start = sum(mi.query_lens[:nd])
    for i in range(nd, mi.num_seqs):
        qlen, slen = mi.query_lens[i], mi.seq_lens[i]
        gather = None
        if slen > qlen:
            pos = torch.arange(slen, device=views.block_tables.device)
            gather = views.block_tables[i][pos // block_size] * block_size + pos % block_size
        prefills.append(PrefillSeq(start, qlen, slen - qlen, gather))
        start += qlen
    return CudaAttentionMetadata(views.slot_mapping, nd, views.block_tables[:nd],
                                 views.seq_lens[:nd], prefills,
                                 plan_fresh_batches(prefills, views.block_tables.device))


def decode_metadata(views: StagedViews, num_rows: int) -> CudaAttentionMetadata:
    """Metadata of a decode-only (graph) batch of ``num_rows`` rows, padding included."""
    return CudaAttentionMetadata(views.slot_mapping[:num_rows], num_rows,
                                 views.block_tables[:num_rows], views.seq_lens[:num_rows], [])


def _default_kernels() -> ModuleType:
    from cadence.backends.cuda import triton_kernels  # triton only when a layer runs

    return triton_kernels


class TritonPagedAttention:
    """``AttentionImpl`` over per-layer flat-slot caches: Triton write + decode, SDPA prefill.

    ``kernels`` is any module with ``write_kv`` and ``paged_decode`` (tests pass the
    interpreted Triton module or a torch stand-in).
    """

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 scale: float, block_size: int, kernels: ModuleType | None = None) -> None:
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.scale = scale
        self.block_size = block_size
        self.kernels = kernels or _default_kernels()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: CudaAttentionMetadata,
                sliding_window: int | None = None, scale: float | None = None,
                soft_cap: float | None = None) -> torch.Tensor:
        scale = self.scale if scale is None else scale
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        self.kernels.write_kv(kc, vc, k, v, metadata.slot_mapping)
        nd = metadata.num_decodes
        if not metadata.prefills:
            return self.kernels.paged_decode(q, kc, vc, metadata.block_tables, metadata.seq_lens,
                                             self.block_size, scale,
                                             sliding_window=sliding_window, soft_cap=soft_cap)
        out = torch.empty_like(q)
        if nd:
            self.kernels.paged_decode(q[:nd], kc, vc, metadata.block_tables, metadata.seq_lens,
                                      self.block_size, scale, out=out[:nd],
                                      sliding_window=sliding_window, soft_cap=soft_cap)
        # fused_context: the math kernel's [H, Lq, Lk] scores would not fit for long contexts.
        run_prefills(q, k, v, kc, vc, metadata.prefills, scale, out, fused_context=True,
                     sliding_window=sliding_window, soft_cap=soft_cap,
                     fresh_batches=metadata.fresh_batches)
        return out
