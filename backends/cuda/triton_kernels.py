"""Triton kernels of the CUDA backend: the KV-cache write, paged-attention decode, and the
scatter of sampled ids into the next step's input ids (async scheduling).

Imported only when a CUDA backend is built (never by ``probe`` or the plugin module), so
``import cadence.backends.cuda`` stays free of triton. On a CPU, set ``TRITON_INTERPRET=1``
before triton is first imported and these kernels run on CPU tensors (how CI tests them).

Cache layout, per layer (shared with the torch reference in ``cadence.layers.paged_attention``):
``[num_blocks * block_size, num_kv_heads, head_dim]``, "flat slots", slot = block * block_size
+ offset. Every kernel upcasts to float32 right after loading: the arithmetic is fp32 whatever
the storage dtype (bf16 arithmetic is also broken in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V rows into the slot.
    # Offsets in int64: a layer's cache passes 2**31 elements on a large card (hence the
    # int64 slot), and tokens x the fused-qkv row stride can at a large token budget.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # Padding tokens (CUDA-graph buckets) carry slot -1: the mask turns them into no-ops.
    # (A scalar bool in a mask is rejected by the interpreter, hence the broadcast slot.)
    valid = (h[:, None] * 0 + slot) >= 0
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & valid
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Triton compiles one variant per integer argument that is 1, divisible by 16, or neither.
# An argument that changes from step to step (the block table's width, a count of rows)
# would compile new variants while requests are being served (~0.35 s each on an H200,
# seen as the first runs of a benchmark being slower); such arguments are excluded.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale, window, soft_cap,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    # One program per (sequence, kv head): the GQA group of query heads sharing that kv head
    # is handled together, so each K/V block is loaded once per group, not once per head.
    # A sliding window (window > 0) keeps keys [seq_len - window, seq_len): the loop starts
    # at the block holding the first of them, so blocks freed behind the window are never read.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_SIZE)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gd_mask, other=0.0).to(tl.float32) * scale  # [G, D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        pos = i * BLOCK_SIZE + n
        n_mask = (pos < seq_len) & (pos >= first)  # the last block may be partly filled
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        off = (block * BLOCK_SIZE + n)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        v = tl.load(v_cache_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        if HAS_CAP:
            # soft_cap * tanh(s / soft_cap), tanh through exp (an overflow to inf gives 1).
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gd_mask)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1; views from a fused qkv keep that."""
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, KVH, D] into the flat-slot caches at ``slot_mapping`` [T]; slot < 0 skips."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 scale: float, out: torch.Tensor | None = None,
                 sliding_window: int | None = None,
                 soft_cap: float | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] over the paged cache -> [B, H, D].

    ``block_tables`` [B, W] (int32/int64) must cover ``seq_lens[b]`` tokens; entries past
    that are never read. ``seq_lens[b] >= 1`` (graph padding rows point at a dummy block).
    ``sliding_window`` W: only the last W tokens are attended (and their blocks read).
    ``soft_cap`` C: the scaled scores become C * tanh(score / C) (Gemma 2).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    q = _inner_contiguous(q)
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and block_size & (block_size - 1) == 0
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window or 0,
        float(soft_cap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        HAS_CAP=soft_cap is not None,
    )
    return out


@triton.jit(do_not_specialize=["n"])
def _scatter_sampled_kernel(input_ids_ptr, idx_ptr, src_ptr, sampled_ptr, n,
                            BLOCK: tl.constexpr):
    # input_ids[idx[i]] = sampled[src[i]] for i < n: async scheduling's placeholders.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dst = tl.load(idx_ptr + offs, mask=mask, other=0)
    src = tl.load(src_ptr + offs, mask=mask, other=0)
    token = tl.load(sampled_ptr + src, mask=mask, other=0)
    tl.store(input_ids_ptr + dst, token.to(input_ids_ptr.dtype.element_ty), mask=mask)


def scatter_sampled(input_ids: torch.Tensor, idx: torch.Tensor, src: torch.Tensor,
                    sampled: torch.Tensor) -> None:
    """``input_ids[idx[i]] = sampled[src[i]]`` on the device (async scheduling fills a
    step's placeholders from the previous step's sampled ids; the host never reads them).
    ``idx`` has no repeats; all three index tensors are 1-D and contiguous."""
    n = idx.numel()
    if n == 0:
        return
    assert input_ids.is_contiguous() and sampled.is_contiguous()
    block = 128
    _scatter_sampled_kernel[(triton.cdiv(n, block),)](input_ids, idx, src, sampled, n,
                                                     BLOCK=block)
