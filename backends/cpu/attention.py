"""The CPU backend's attention, all compiled (csrc/): decode rows through the paged kernel
(paged_attention.cpp), which reads K/V blocks in place; the fresh prompts of a step in one
call with the decode kernel's arithmetic (prefill_attention.cpp); chunks with cached context
row by row through the decode kernel (see ``build_metadata``); the cache write in one pass
(ops.cpp). A layer's sliding window goes to each kernel call; the kernels read only the
window's blocks, so blocks the engine freed behind it are never touched.

The kernel reads the core's flat-slot cache ([num_slots, KVH, D], viewed as
[num_blocks, block_size, KVH, D]) as it is. It accepts any strided layout with that index
order; a head-major block layout ([num_blocks, KVH, block_size, D]) measured no faster here
(docs/backends/cpu.md), so the core's layout is kept and the torch reference path can read
the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from cadence.backend import ModelInput

# head_dim values the kernel is instantiated for (csrc/paged_attention.cpp dispatch_dim).
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class ContextChunk:
    """A prefill chunk with cached context, attended one query row at a time by the decode
    kernel: row i sees the first ``lens[i]`` tokens of the sequence (causal)."""

    query_start: int
    query_len: int
    tables: torch.Tensor  # [query_len, num_blocks] int32: the sequence's table on every row
    lens: torch.Tensor  # [query_len] int32: context_len + 1 ... context_len + query_len


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32, padded with 0
    decode_lens: torch.Tensor | None  # [num_decodes] int32: tokens in the cache
    # Fresh prompts (no cached context): first token and length of each, int64 [n] (None: none)
    prefill_starts: torch.Tensor | None
    prefill_lens: torch.Tensor | None
    context_chunks: list[ContextChunk]


def build_metadata(mi: ModelInput, block_size: int, device: torch.device | str = "cpu"
                   ) -> CpuAttentionMetadata:
    """NOTE exactness: a chunk with cached context (a chunked prefill's later chunks, a
    prefix-cache hit, or a request recomputed after preemption) goes through the decode
    kernel row by row, not through SDPA. A token's attention then has the same bits whether
    it was computed as a decode or inside such a chunk, so async on == off stays exact even
    when the two preempt at different moments (the recompute would otherwise produce K/V a
    few ulps off the originals, and every later token would inherit the difference)."""
    slot_mapping = torch.tensor(mi.slot_mapping, dtype=torch.int64)
    nd = mi.num_decodes
    tables = lens = None
    if nd:
        need = (max(mi.seq_lens[:nd]) + block_size - 1) // block_size
        rows = [bt[:need] + [0] * (need - len(bt[:need])) for bt in mi.block_tables[:nd]]
        tables = torch.tensor(rows, dtype=torch.int32)
        lens = torch.tensor(mi.seq_lens[:nd], dtype=torch.int32)
    starts, fresh_lens, chunks = [], [], []
    start = sum(mi.query_lens[:nd])
    for i in range(nd, mi.num_seqs):
        qlen, slen = mi.query_lens[i], mi.seq_lens[i]
        ctx = slen - qlen
        if ctx == 0:
            starts.append(start)
            fresh_lens.append(qlen)
        else:
            need = (slen + block_size - 1) // block_size
            table = torch.tensor(mi.block_tables[i][:need], dtype=torch.int32)
            chunks.append(ContextChunk(start, qlen, table.expand(qlen, need).contiguous(),
                                       torch.arange(ctx + 1, slen + 1, dtype=torch.int32)))
        start += qlen
    fresh = (torch.tensor(starts, dtype=torch.int64), torch.tensor(fresh_lens, dtype=torch.int64)
             ) if starts else (None, None)
    return CpuAttentionMetadata(slot_mapping, nd, tables, lens, *fresh, chunks)


# Attention keywords (core/layers/attention.py) the compiled kernels implement.
KERNEL_FEATURES = ("sliding_window", "scale", "soft_cap")


def kernel_supports(head_dim: int, dtype: torch.dtype,
                    features: set[str] | frozenset[str] = frozenset()) -> str | None:
    """None if the compiled kernel handles this model (its head size, dtype and the attention
    keywords its layers pass), else the reason it does not."""
    missing = sorted(set(features) - set(KERNEL_FEATURES))
    if missing:
        return f"the model's attention needs {', '.join(missing)}, which the kernel lacks"
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {KERNEL_HEAD_DIMS}"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not float32 or bfloat16"
    return None


class CpuPagedAttention:
    """``AttentionImpl`` with the compiled decode kernel; see the module docstring."""

    def __init__(self, kernels: ModuleType, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], block_size: int, scale: float) -> None:
        self.ops = kernels
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.scale = scale
        # [num_slots, KVH, D] -> [num_blocks, block_size, KVH, D]: views, no copy.
        self.k_blocks = [c.view(-1, block_size, *c.shape[1:]) for c in k_caches]
        self.v_blocks = [c.view(-1, block_size, *c.shape[1:]) for c in v_caches]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: CpuAttentionMetadata,
                sliding_window: int | None = None, scale: float | None = None,
                soft_cap: float | None = None) -> torch.Tensor:
        window = sliding_window or 0  # the kernels' "no window"
        scale = self.scale if scale is None else scale
        cap = soft_cap or 0.0  # the kernels' "no cap"
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        kb, vb = self.k_blocks[layer_idx], self.v_blocks[layer_idx]
        self.ops.write_kv(kc, vc, k, v, metadata.slot_mapping)
        nd = metadata.num_decodes
        decode = None
        if nd:
            decode = self.ops.paged_decode_attention(q[:nd], kb, vb, metadata.decode_tables,
                                                     metadata.decode_lens, scale, window, cap)
            if metadata.prefill_starts is None and not metadata.context_chunks:
                return decode
        out = torch.empty_like(q)
        if decode is not None:
            out[:nd] = decode
        for c in metadata.context_chunks:
            s, e = c.query_start, c.query_start + c.query_len
            out[s:e] = self.ops.paged_decode_attention(q[s:e], kb, vb, c.tables, c.lens,
                                                       scale, window, cap)
        if metadata.prefill_starts is not None:
            self.ops.prefill_attention(q, k, v, out, metadata.prefill_starts,
                                       metadata.prefill_lens, scale, window, cap)
        return out
