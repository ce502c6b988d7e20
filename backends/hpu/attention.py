"""Static-shape paged attention for the HPU backend, and the graphed forward it runs in.

Every tensor here has a bucket shape (see ``buckets.py``), so one compiled graph serves all
steps of that bucket. The KV cache is the core's flat-slot layout per layer,
``[num_blocks * block_size, num_kv_heads, head_dim]``, viewed as blocks for the gather.

- decode: gather the ``num_blocks`` blocks of every row's block table with one
  ``index_select`` ([B, NB * block_size] keys), mask keys past ``seq_len``, softmax.
- prefill without cached context: causal attention over the chunk's own K/V, through
  Habana's fused SDPA when the bridge has it, else torch SDPA.
- prefill after cached context: the chunk's K/V are written first, then the whole context
  is gathered like a decode, with a causal-by-position mask.

A layer with a sliding window narrows the step's mask to the window (built once per window
and step, inside the graph: the window is a constant of its layer). Blocks the engine freed
behind the window are still gathered, since the shapes are the bucket's, and masked out.

In emulation on CPU tensors every path runs ``exact_attention.py`` instead, with the same
masks, so a token's bits do not depend on the path that computed it (see there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cadence.backends.hpu.buckets import PaddedBatch
from cadence.backends.hpu.exact_attention import exact_attention
from cadence.forward_context import set_forward_context
from cadence.layers.paged_attention import capped_attention


@dataclass(slots=True)
class HpuAttentionMetadata:
    """Per-step attention inputs, all of bucket shape."""

    is_decode: bool
    batch_size: int
    query_len: int
    slot_mapping: torch.Tensor  # [B * Q] int64; padding -> the dummy slot
    block_tables: torch.Tensor  # [B, NB] int64; padding -> the dummy block
    # decode: [B, 1, 1, L]; prefill with context: [B, 1, Q, L]; None: causal over the chunk.
    attn_mask: torch.Tensor | None
    positions: torch.Tensor | None = None  # [B, Q] query positions
    seq_lens: torch.Tensor | None = None  # [B] tokens in the cache, this step's included
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """``attn_mask`` narrowed to a layer's window (None: the step's own mask)."""
        if sliding_window is None:
            return self.attn_mask
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            mask = self.window_masks[sliding_window] = self._window_mask(sliding_window)
        return mask

    def _window_mask(self, w: int) -> torch.Tensor:
        b, ql = self.batch_size, self.query_len
        if self.attn_mask is None:  # a fresh chunk: key index = position
            idx = torch.arange(ql, device=self.slot_mapping.device)
            causal = (idx.view(1, -1) <= idx.view(-1, 1)) & (idx.view(1, -1) > idx.view(-1, 1) - w)
            return causal.view(1, 1, ql, ql).expand(b, 1, ql, ql)
        length = self.attn_mask.shape[-1]
        keys = torch.arange(length, device=self.attn_mask.device)
        if self.is_decode:
            recent = keys.view(1, -1) >= (self.seq_lens.view(b, 1) - w)  # [B, L]
            return self.attn_mask & recent.view(b, 1, 1, length)
        recent = keys.view(1, 1, -1) > (self.positions.view(b, ql, 1) - w)  # [B, Q, L]
        return self.attn_mask & recent.view(b, 1, ql, length)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int
                  ) -> torch.Tensor:
    """cache [S, KVH, D] (S = blocks * block_size), block_tables [B, NB] -> [B, NB*bs, KVH, D]."""
    s, kvh, d = cache.shape
    b, nb = block_tables.shape
    blocks = cache.view(s // block_size, block_size, kvh, d)
    return blocks.index_select(0, block_tables.reshape(-1)).view(b, nb * block_size, kvh, d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, soft_cap: float | None = None) -> torch.Tensor:
    """q [B, H, D], k/v [B, L, KVH, D], mask [B, 1, 1, L] (True = attend) -> [B, H, D];
    ``soft_cap`` C caps the scaled scores at C * tanh(score / C)."""
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.to(q.dtype)) * scale  # [B, KVH, G, L]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bkgl,blkd->bkgd", probs, v.to(q.dtype)).reshape(b, h, d)


SdpaFn = Callable[..., torch.Tensor]


class HpuPagedAttention:
    """``AttentionImpl`` for the HPU backend (see the module docstring)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 block_size: int, scale: float, fused_sdpa: SdpaFn | None = None,
                 exact_len: int | None = None) -> None:
        """``exact_len``: the emulation's fixed key length; every path then runs
        ``exact_attention`` (see exact_attention.py), so a token's output does not depend on
        which path computed it. None (a Gaudi): the paths below."""
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.block_size = block_size
        self.scale = scale
        self.fused_sdpa = fused_sdpa
        self.exact_len = exact_len

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, scale: float,
              soft_cap: float | None = None) -> torch.Tensor:
        """q [B, H, Q, D], k/v [B, H, L, D]; mask None = causal, else [B, 1, Q, L] bool."""
        if soft_cap is not None:  # neither FusedSDPA nor SDPA caps scores
            if mask is None:
                ql, kl = q.shape[-2], k.shape[-2]
                mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
            return capped_attention(q, k, v, mask, scale, soft_cap)
        if self.fused_sdpa is not None:
            # FusedSDPA takes an additive mask; every row attends to at least key 0, so the
            # large negative never turns a whole row into NaN.
            add = None if mask is None else torch.where(
                mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
            return self.fused_sdpa(q, k, v, add, 0.0, mask is None, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: HpuAttentionMetadata, sliding_window: int | None = None,
                scale: float | None = None, soft_cap: float | None = None) -> torch.Tensor:
        scale = self.scale if scale is None else scale
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        kc.index_copy_(0, md.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, md.slot_mapping, v.to(vc.dtype))
        mask = md.mask_for(sliding_window)
        if self.exact_len is not None:
            return self._exact(kc, vc, q, md, mask, scale, soft_cap)
        if md.is_decode:
            kb = gather_blocks(kc, md.block_tables, self.block_size)
            vb = gather_blocks(vc, md.block_tables, self.block_size)
            return decode_attention(q, kb, vb, mask, scale, soft_cap)
        b, ql = md.batch_size, md.query_len
        _, h, d = q.shape
        if md.attn_mask is None:
            kb, vb = k.view(b, ql, -1, d), v.view(b, ql, -1, d)
        else:
            kb = gather_blocks(kc, md.block_tables, self.block_size).to(q.dtype)
            vb = gather_blocks(vc, md.block_tables, self.block_size).to(q.dtype)
        kvh = kb.shape[2]
        qt = q.view(b, ql, h, d).transpose(1, 2)  # [B, H, Q, D]
        kt = kb.transpose(1, 2).repeat_interleave(h // kvh, dim=1)  # [B, H, L, D]
        vt = vb.transpose(1, 2).repeat_interleave(h // kvh, dim=1)
        out = self._sdpa(qt, kt, vt, mask, scale, soft_cap)  # [B, H, Q, D]
        return out.transpose(1, 2).reshape(b * ql, h, d)

    def _exact(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor,
               md: HpuAttentionMetadata, mask: torch.Tensor | None, scale: float,
               soft_cap: float | None) -> torch.Tensor:
        b, ql = md.batch_size, md.query_len
        _, h, d = q.shape
        if md.attn_mask is None and not md.is_decode:
            # A fresh chunk: its keys are its own slots, key index = position.
            kb = kc.index_select(0, md.slot_mapping).view(b, ql, -1, d)
            vb = vc.index_select(0, md.slot_mapping).view(b, ql, -1, d)
            if mask is None:
                mask = torch.ones(ql, ql, dtype=torch.bool, device=q.device).tril()
                mask = mask.expand(b, 1, ql, ql)
        else:
            kb = gather_blocks(kc, md.block_tables, self.block_size)
            vb = gather_blocks(vc, md.block_tables, self.block_size)
        out = exact_attention(q.view(b, ql, h, d), kb, vb, mask.reshape(b, ql, -1), scale,
                              self.exact_len, soft_cap)
        return out.reshape(b * ql, h, d)


class GraphedForward(nn.Module):
    """The model's forward plus the logits of one row per sequence, for one kind of shape.

    Every per-step tensor is a ``forward`` argument and the attention metadata is built
    inside, because an HPU graph replays with new values only for its inputs: a tensor read
    from a global would be baked into the graph. One instance per kind (decode, prefill,
    prefill with context) keeps shapes of different kinds from sharing a graph cache.
    On a pipeline stage before the last it returns None (the model sent its activations).
    ``with_hidden``: it returns (logits, every token row's hidden state), for prompt
    logprobs and embeddings; a graph of its own, compiled on first use.
    """

    def __init__(self, model: nn.Module, attn: HpuPagedAttention, kind: str,
                 with_hidden: bool = False) -> None:
        super().__init__()
        self.model = model
        self.attn = attn
        self.kind = kind
        self.with_hidden = with_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        b = logits_indices.shape[0]
        ql = input_ids.shape[0] // b
        mask = None
        if self.kind != "prefill":
            keys = torch.arange(block_tables.shape[1] * self.attn.block_size,
                                device=input_ids.device)
            within = keys.view(1, 1, -1) < seq_lens.view(b, 1, 1)  # [B, 1, L]
            if self.kind == "decode":
                mask = within.view(b, 1, 1, -1)
            else:
                causal = keys.view(1, 1, -1) <= positions.view(b, ql, 1)  # [B, Q, L]
                mask = (causal & within).view(b, 1, ql, -1)
        md = HpuAttentionMetadata(self.kind == "decode", b, ql, slot_mapping, block_tables, mask,
                                  positions.view(b, ql), seq_lens)
        with set_forward_context(self.attn, md):
            hidden = self.model(input_ids, positions)  # [B * Q, hidden]
        if hidden is None:  # a pipeline stage before the last: its activations went on
            return None
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))  # [B, V]
        return (logits, hidden) if self.with_hidden else logits


def graph_kind(pb: PaddedBatch) -> str:
    if pb.shape.kind == "decode":
        return "decode"
    return "prefill_ctx" if pb.shape.num_blocks else "prefill"


def to_tensors(pb: PaddedBatch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The ``GraphedForward`` arguments of a padded batch, on ``device``."""
    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

    return (t(pb.input_ids), t(pb.positions), t(pb.slot_mapping),
            t(pb.block_tables).view(pb.shape.batch_size, pb.shape.num_blocks),
            t(pb.seq_lens), t(pb.logits_indices))
