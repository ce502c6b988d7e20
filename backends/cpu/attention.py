"""The CPU backend's attention, all compiled (csrc/): decode rows through the paged kernel
(paged_attention.cpp), which reads K/V blocks in place; the fresh prompts of a step in one
call with the decode kernel's arithmetic (prefill_attention.cpp); chunks with cached context
row by row through the decode kernel, in the decodes' call (see ``build_metadata``); the
cache write in one pass (ops.cpp). A layer's sliding window goes to each kernel call; the
kernels read only the window's blocks, so blocks the engine freed behind it are never
touched.

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
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Rows through the decode kernel, in one call: the decodes, then every query row of each
    # chunk with cached context (row i of a chunk sees its sequence's first context + i + 1
    # tokens: causal).
    num_kernel_rows: int
    kernel_rows: torch.Tensor | None  # int64 [num_kernel_rows] rows of q; None: q's first rows
    kernel_tables: torch.Tensor | None  # [num_kernel_rows, max_blocks] int32, padded with 0
    kernel_lens: torch.Tensor | None  # [num_kernel_rows] int32: tokens each row attends to
    # Fresh prompts (no cached context): first token and length of each, int64 [n] (None: none)
    prefill_starts: torch.Tensor | None
    prefill_lens: torch.Tensor | None


def build_metadata(mi: ModelInput, block_size: int, device: torch.device | str = "cpu"
                   ) -> CpuAttentionMetadata:
    """NOTE exactness: a chunk with cached context (a chunked prefill's later chunks, a
    prefix-cache hit, or a request recomputed after preemption) goes through the decode
    kernel row by row, not through SDPA. A token's attention then has the same bits whether
    it was computed as a decode or inside such a chunk, so async on == off stays exact even
    when the two preempt at different moments (the recompute would otherwise produce K/V a
    few ulps off the originals, and every later token would inherit the difference). The
    kernel's rows are batch-invariant, so every such chunk of a step rides in the decodes'
    call: one call per layer instead of one per chunk (64 prefix-cache hits in a step were
    64 calls per layer, each with its own query scaling and copy)."""
    slot_mapping = torch.tensor(mi.slot_mapping, dtype=torch.int64)
    nd = mi.num_decodes
    # One table per decode or chunk, repeated over the chunk's rows below.
    tables = [bt[:(n + block_size - 1) // block_size]
              for bt, n in zip(mi.block_tables[:nd], mi.seq_lens[:nd])]
    lens = list(mi.seq_lens[:nd])
    chunks = []  # (first row in q, rows) of each chunk with cached context
    starts, fresh_lens = [], []
    start = nd  # a decode is one query row
    for i in range(nd, mi.num_seqs):
        qlen, slen = mi.query_lens[i], mi.seq_lens[i]
        ctx = slen - qlen
        if ctx == 0:
            starts.append(start)
            fresh_lens.append(qlen)
        else:
            tables.append(mi.block_tables[i][:(slen + block_size - 1) // block_size])
            lens.extend(range(ctx + 1, slen + 1))
            chunks.append((start, qlen))
        start += qlen
    num_rows = len(lens)
    rows = kernel_tables = kernel_lens = None
    if num_rows:
        width = max(len(t) for t in tables)
        kernel_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                     dtype=torch.int32)
        kernel_lens = torch.tensor(lens, dtype=torch.int32)
    if chunks:
        kernel_tables = kernel_tables.repeat_interleave(
            torch.tensor([1] * nd + [n for _, n in chunks]), dim=0)
        # The kernel's rows are q[:num_rows] unless a fresh prompt sits before a chunk.
        if sum(chunks[-1]) != num_rows:
            rows = torch.cat([torch.arange(nd), *(torch.arange(s, s + n) for s, n in chunks)])
    fresh = (torch.tensor(starts, dtype=torch.int64), torch.tensor(fresh_lens, dtype=torch.int64)
             ) if starts else (None, None)
    return CpuAttentionMetadata(slot_mapping, num_rows, rows, kernel_tables, kernel_lens, *fresh)


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
        n, rows = metadata.num_kernel_rows, metadata.kernel_rows
        if n:
            res = self.ops.paged_decode_attention(q[:n] if rows is None else q[rows], kb, vb,
                                                  metadata.kernel_tables, metadata.kernel_lens,
                                                  scale, window, cap)
            if metadata.prefill_starts is None:  # every row is a kernel row, in order
                return res
        out = torch.empty_like(q)
        if n:
            if rows is None:
                out[:n] = res
            else:
                out.index_copy_(0, rows, res)
        if metadata.prefill_starts is not None:
            self.ops.prefill_attention(q, k, v, out, metadata.prefill_starts,
                                       metadata.prefill_lens, scale, window, cap)
        return out
