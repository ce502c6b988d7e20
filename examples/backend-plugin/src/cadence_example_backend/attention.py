"""Attention over cadence's paged KV cache, one sequence at a time.

The cache is what ``ModelRunner.allocate_kv_cache`` allocates: per layer, keys and values of
shape ``[num_blocks * block_size, num_kv_heads, head_dim]``, indexed by slot id
(``block * block_size + offset``). Each step this layer writes the new tokens' K/V at
``ModelInput.slot_mapping``, then, per sequence, gathers the whole context by slot id and
runs ``scaled_dot_product_attention`` with a causal mask shifted by the cached length.
Simple rather than fast: one SDPA call per sequence, no batching of decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.backend import ModelInput


@dataclass(slots=True)
class SequenceSlice:
    query_start: int  # first row of this sequence in the flattened batch
    query_len: int
    context_slots: torch.Tensor  # [seq_len] slot ids of positions 0 .. seq_len - 1


@dataclass(slots=True)
class ExampleMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    seqs: list[SequenceSlice]


def build_metadata(mi: ModelInput, block_size: int, device: torch.device | str = "cpu"
                   ) -> ExampleMetadata:
    """Host description of a step -> index tensors (``ModelRunner.prepare`` calls this)."""
    seqs, start = [], 0
    for query_len, seq_len, table in zip(mi.query_lens, mi.seq_lens, mi.block_tables):
        pos = torch.arange(seq_len)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // block_size]
        seqs.append(SequenceSlice(start, query_len,
                                  (blocks * block_size + pos % block_size).to(device)))
        start += query_len
    slot_mapping = torch.tensor(mi.slot_mapping, dtype=torch.int64, device=device)
    return ExampleMetadata(slot_mapping, seqs)


class PerSequenceAttention:
    """cadence's ``AttentionImpl`` protocol:
    ``forward(layer_idx, q, k, v, metadata, sliding_window=None)``."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 scale: float) -> None:
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: ExampleMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the T new tokens -> [T, H, D]. With
        ``sliding_window`` W the query at position p sees keys p - W < j <= p only."""
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]  # query heads per KV head (GQA)
        for s in metadata.seqs:
            end = s.query_start + s.query_len
            qs = q[s.query_start:end].transpose(0, 1)  # [H, Lq, D]
            ks = k_cache[s.context_slots].to(q.dtype).transpose(0, 1)  # [KVH, L, D]
            vs = v_cache[s.context_slots].to(q.dtype).transpose(0, 1)
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            # Query i sits at position L - Lq + i and sees keys 0 .. that position.
            seq_len = ks.shape[1]
            ones = torch.ones(s.query_len, seq_len, dtype=torch.bool, device=q.device)
            mask = ones.tril(seq_len - s.query_len)
            if sliding_window is not None:
                mask &= ones.triu(seq_len - s.query_len - sliding_window + 1)
            attn = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[s.query_start:end] = attn.transpose(0, 1)
        return out
