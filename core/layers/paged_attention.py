"""Attention over the paged KV cache in plain torch: the CPU implementation, and the
reference the device kernels are tested against.

Cache layout, per layer: ``[num_blocks * block_size, num_kv_heads, head_dim]`` for keys and
for values ("flat slots"), so the write is one ``index_copy_`` by slot id and a gather is one
index by slot ids. Sequences in a step are ordered decodes first, then prefill chunks.

Sliding windows (``sliding_window`` W of a layer) are masks here: a decode row keeps keys
``seq_len - W <= j < seq_len``, a prefill row at position i keys ``i - W < j <= i``. Blocks
wholly behind the window may already be freed (their table entries name block 0); they are
still gathered, and masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cadence.backend import ModelInput
from cadence.layers.prefill_batch import FreshPrefillBatch, run_fresh_batch


@dataclass(slots=True)
class PrefillSeq:
    query_start: int
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    # Slot ids of the whole context (cached + this chunk); None when there is no cached
    # context, in which case the chunk attends to its own K/V without touching the cache.
    gather_slots: torch.Tensor | None


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] block ids (padded with 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq]
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64: tokens in the cache
    # decode_mask narrowed to each sliding window a layer asked for, built on first use.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """The decode rows' mask for a layer with this window (None: the whole context)."""
        if sliding_window is None or self.decode_mask is None:
            return self.decode_mask
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            n, length = self.decode_mask.shape[0], self.decode_mask.shape[-1]
            keys = torch.arange(length, device=self.decode_mask.device)
            recent = keys.unsqueeze(0) >= (self.decode_lens - sliding_window).unsqueeze(1)
            mask = self.window_masks[sliding_window] = \
                self.decode_mask & recent.view(n, 1, 1, length)
        return mask


def build_metadata(mi: ModelInput, block_size: int, device: torch.device | str = "cpu"
                   ) -> TorchAttentionMetadata:
    """Turn the host description of a step into the index tensors the kernels use."""
    slot_mapping = torch.tensor(mi.slot_mapping, dtype=torch.int64, device=device)
    nd = mi.num_decodes
    decode_tables = decode_mask = decode_lens = None
    if nd:
        # Whole blocks are gathered, so the padded length is a multiple of block_size. That
        # also keeps each row's reduction order independent of the other rows' lengths
        # (measured: torch's CPU reductions give bitwise-equal rows only when the padded
        # length stays on such a boundary), which async == sync equality relies on.
        max_blocks = max(len(bt) for bt in mi.block_tables[:nd])
        need = (max(mi.seq_lens[:nd]) + block_size - 1) // block_size
        max_blocks = min(max_blocks, need)
        # One tensor from padded lists: a per-row torch.tensor() costs more than the copy.
        rows = [bt[:max_blocks] + [0] * (max_blocks - len(bt[:max_blocks]))
                for bt in mi.block_tables[:nd]]
        max_len = max_blocks * block_size
        lens = torch.tensor(mi.seq_lens[:nd], dtype=torch.int64)
        valid = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)
        decode_tables = torch.tensor(rows, dtype=torch.int64, device=device)
        decode_mask = valid.view(nd, 1, 1, max_len).to(device)
        decode_lens = lens.to(device)
    prefills = []
    start = sum(mi.query_lens[:nd])
    for i in range(nd, mi.num_seqs):
        qlen, slen = mi.query_lens[i], mi.seq_lens[i]
        ctx = slen - qlen
        gather = None
        if ctx > 0:
            bt = mi.block_tables[i]
            pos = torch.arange(slen, dtype=torch.int64)
            table = torch.tensor(bt, dtype=torch.int64)
            gather = (table[pos // block_size] * block_size + pos % block_size).to(device)
        prefills.append(PrefillSeq(start, qlen, ctx, gather))
        start += qlen
    return TorchAttentionMetadata(slot_mapping, nd, decode_tables, decode_mask, prefills,
                                  decode_lens)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, soft_cap: float) -> torch.Tensor:
    """Attention with the scores soft-capped, in transformers' eager order: q [..., H, Lq, D],
    k/v [..., H, Lk, D] (KV heads already repeated), mask [..., Lq, Lk] (True = attend,
    broadcast) -> [..., H, Lq, D]. SDPA has no cap, hence the plain ops."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, mask: torch.Tensor, scale: float,
                     soft_cap: float | None = None) -> torch.Tensor:
    """q [B, H, D]; tables [B, NB] block ids; mask [B, 1, 1, NB * block_size] -> [B, H, D].

    The caches are flat slots [num_slots, KVH, D]; whole blocks are gathered.
    """
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    nb = tables.shape[1]
    block_size = mask.shape[-1] // nb
    # [B, NB, bs, KVH, D] -> [B, KVH, L, D] as a view; SDPA's CPU kernel takes the strides,
    # and measured ~1.7x faster here than einsum + softmax + einsum (no permute copies).
    k = k_cache.view(-1, block_size, kvh, d)[tables].view(b, nb * block_size, kvh, d)
    v = v_cache.view(-1, block_size, kvh, d)[tables].view(b, nb * block_size, kvh, d)
    if soft_cap is not None:
        kt = k.transpose(1, 2).repeat_interleave(h // kvh, dim=1)  # [B, H, L, D]
        vt = v.transpose(1, 2).repeat_interleave(h // kvh, dim=1)
        return capped_attention(q.view(b, h, 1, d), kt, vt, mask, scale, soft_cap).view(b, h, d)
    out = F.scaled_dot_product_attention(q.view(b, h, 1, d), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask, scale=scale,
                                         enable_gqa=kvh != h)
    return out.view(b, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                      scale: float, fused_context: bool = False,
                      sliding_window: int | None = None,
                      soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of a chunk: q [Lq, H, D] at positions context_len.., k/v [Lk, KVH, D]
    covering positions 0..Lk-1 (Lk = context_len + Lq) -> [Lq, H, D]. With
    ``sliding_window`` W, the row at position i sees keys i - W < j <= i only.

    NOTE two kernels. SDPA's flash kernels (CPU and CUDA) take only 4-D [B, H, L, D] inputs;
    a 3-D call runs the math kernel, which materialises the [H, Lq, Lk] scores (measured on
    this CPU: the flash kernel is 3x faster at 128 tokens, 5.6x at 2048). Fresh prompts
    (``context_len == 0``) always take the flash kernel. A chunk with cached context takes
    the math kernel unless ``fused_context``: that chunk may be a recompute after a
    preemption, and the math kernel's rows are what keeps async == sync bit-exact when the
    two preempt at different moments (the flash kernel's differ from the decode kernel's in
    the last bits; measured with the conformance kit). Device backends, where the scores
    would not fit, pass ``fused_context=True``.
    """
    lq, h, _ = q.shape
    lk, kvh, _ = k.shape
    if soft_cap is not None:
        return _capped_prefill(q, k, v, context_len, scale, sliding_window, soft_cap)
    fused = context_len == 0 or fused_context
    # The window cuts nothing until some query is W or more positions in.
    windowed = sliding_window is not None and lk > sliding_window
    masked = context_len != 0 or windowed
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, L, D]
    if fused:
        qt, kt, vt = qt.unsqueeze(0), kt.unsqueeze(0), vt.unsqueeze(0)  # [1, heads, L, D]
    if kvh != h and masked:
        # Not enable_gqa here: kernels that do not take it (the masked path's) would send
        # the call back to the math kernel. The causal flash kernel takes it and reads each
        # KV head once (measured bitwise equal to repeating K/V, without the copies).
        kt = kt.repeat_interleave(h // kvh, dim=-3)
        vt = vt.repeat_interleave(h // kvh, dim=-3)
    if not masked:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                             enable_gqa=kvh != h)
    else:
        # is_causal aligns the diagonal top-left, wrong when Lq < Lk: an explicit mask.
        qpos = torch.arange(context_len, context_len + lq, device=q.device).unsqueeze(1)
        keys = torch.arange(lk, device=q.device).unsqueeze(0)
        mask = keys <= qpos
        if windowed:
            mask &= keys > qpos - sliding_window
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return (out[0] if fused else out).transpose(0, 1)


def _capped_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                    scale: float, sliding_window: int | None, soft_cap: float) -> torch.Tensor:
    """``prefill_attention`` with soft-capped scores (``capped_attention``)."""
    lq, h, _ = q.shape
    lk, kvh, _ = k.shape
    qpos = torch.arange(context_len, context_len + lq, device=q.device).unsqueeze(1)
    keys = torch.arange(lk, device=q.device).unsqueeze(0)
    mask = keys <= qpos
    if sliding_window is not None:
        mask &= keys > qpos - sliding_window
    kt = k.transpose(0, 1).repeat_interleave(h // kvh, dim=0)  # [H, Lk, D]
    vt = v.transpose(0, 1).repeat_interleave(h // kvh, dim=0)
    return capped_attention(q.transpose(0, 1), kt, vt, mask, scale, soft_cap).transpose(0, 1)


def run_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, prefills: list[PrefillSeq], scale: float,
                 out: torch.Tensor, fused_context: bool = False,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 fresh_batches: Sequence[FreshPrefillBatch] = ()) -> None:
    """Prefill chunks into ``out``, one sequence at a time; shared by the device backends.
    ``fresh_batches`` (``plan_fresh_batches``) run their prompts in one call each where
    this layer allows it, and the rest go one at a time.

    Under a sliding window a chunk gathers its context from the first key its first query
    sees, so blocks freed behind the window are not read."""
    done: set[int] = set()
    for batch in fresh_batches:
        if batch.usable(sliding_window, soft_cap):
            run_fresh_batch(batch, q, k, v, scale, out)
            done |= batch.members
    for i, p in enumerate(prefills):
        if i in done:
            continue
        s, e = p.query_start, p.query_start + p.query_len
        context_len = p.context_len
        if p.gather_slots is None:
            ks, vs = k[s:e], v[s:e]
        else:
            slots = p.gather_slots
            if sliding_window is not None and context_len >= sliding_window:
                first = context_len + 1 - sliding_window
                slots, context_len = slots[first:], context_len - first  # positions shift
            ks, vs = k_cache[slots], v_cache[slots]
        out[s:e] = prefill_attention(q[s:e], ks.to(q.dtype), vs.to(q.dtype), context_len,
                                     scale, fused_context, sliding_window, soft_cap)


class TorchPagedAttention:
    """``AttentionImpl`` over per-layer flat-slot caches, in torch ops."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 scale: float) -> None:
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: TorchAttentionMetadata,
                sliding_window: int | None = None, scale: float | None = None,
                soft_cap: float | None = None) -> torch.Tensor:
        scale = self.scale if scale is None else scale
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        write_kv(kc, vc, k, v, metadata.slot_mapping)
        nd = metadata.num_decodes
        mask = metadata.decode_mask_for(sliding_window)
        if not metadata.prefills:
            return decode_attention(q, kc, vc, metadata.decode_tables, mask, scale, soft_cap)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(q[:nd], kc, vc, metadata.decode_tables, mask, scale,
                                        soft_cap)
        run_prefills(q, k, v, kc, vc, metadata.prefills, scale, out,
                     sliding_window=sliding_window, soft_cap=soft_cap)
        return out
