"""Fused mixture-of-experts kernels of the CUDA backend, in the shape of vLLM's fused_moe.

The (token, expert) pairs of a step are sorted by expert and each expert's run is padded
to a multiple of ``BLOCK_M`` (``align_by_expert``), so that every block of ``BLOCK_M``
sorted pairs belongs to one expert. Then two grouped GEMMs run over those blocks:

1. ``_gate_up_kernel``: for each block tile, ``x[token] @ w13[e]``'s gate and up halves
   with ``tl.dot`` and SiLU-and-mul in the epilogue: h [pairs, I];
2. ``_down_kernel``: ``h @ w2[e]`` scaled by the pair's routing weight: [pairs, H];

and the top-k rows of each token are summed. Every expert's weights are read once per
block of its tokens, and no expert loop or token count ever reaches the host: the grid and
every buffer are sized from the number of tokens alone (blocks past the last expert's are
launched and return at once), so the sequence is free of host syncs and its shapes are
static per token count, what a CUDA graph needs.

Imported only when an MoE layer of a CUDA backend runs; ``TRITON_INTERPRET=1`` runs it on
CPU tensors as for the attention kernels (``triton_kernels``). The GEMMs take the storage
dtype (tensor cores for bf16/fp16) and accumulate in fp32; fp32 models multiply in full
fp32 (``input_precision="ieee"``, not TF32), as torch's reference does by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the pairs of ``ids`` [T, k] by expert, each expert's run padded to ``block_m``.

    Returns ``sorted_pairs`` [num_blocks * block_m] (pair p = token p // k's choice p % k;
    padding holds T * k) and ``block_experts`` [num_blocks] (the expert of each block, -1
    for blocks past the last expert's). ``num_blocks`` bounds the padded length from T, k
    and the expert count alone (every expert padded by at most block_m - 1, and no more
    experts used than pairs), so nothing is read back to the host.
    """
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    num_blocks = triton.cdiv(min(n + num_experts * (block_m - 1), n * block_m), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int64, device=flat.device)
    sorted_pairs[(padded_end - padded)[expert] + rank] = order
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts.to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs"])  # per step: see triton_kernels.py
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_pairs, N, K,
    stride_xt, stride_we, stride_wn, stride_ht,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    # One program per (block of sorted pairs, BLOCK_N columns of the intermediate): the
    # gate columns n and the up columns N + n of w13[e] go through two accumulators, so
    # SiLU-and-mul happens before the store and h is [pairs, N], not [pairs, 2N].
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e * stride_we
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        k_ok = kk < K
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        bg = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                     mask=b_mask, other=0.0)
        bu = tl.load(w_base + (offs_n[None, :] + N).to(tl.int64) * stride_wn + kk[:, None],
                     mask=b_mask, other=0.0)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + pairs[:, None].to(tl.int64) * stride_ht + offs_n[None, :],
             h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # per step: see triton_kernels.py
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, block_expert_ptr, num_pairs, N, K,
    stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (block of sorted pairs, BLOCK_N hidden columns): h[pair] @ w2[e]^T,
    # times the pair's routing weight (in fp32), stored at the pair's row.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        k_ok = kk < K
        a = tl.load(h_ptr + rows[:, None] * stride_ht + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def block_sizes(num_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks for decode-sized steps (few pairs per
    expert, so less padding), larger ones for prefills. ``tl.dot`` needs 16 at least."""
    return (16 if num_pairs <= 256 else 64), 64, 64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H]; ``w13`` [E, 2I, H]
    (gate rows then up rows), ``w2`` [E, H, I], ``weights`` and ``ids`` [T, k].

    ``expert_map`` (expert parallel): global expert id -> its index in w13/w2, -1 for an
    expert this rank does not hold; the pairs routed to those add nothing."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and w2.shape[1:] == (hidden, inter)
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_pairs = num_tokens * top_k
    bm, bn, bk = block_sizes(num_pairs)
    if expert_map is None:
        sorted_pairs, block_experts = align_by_expert(ids, num_experts, bm)
    else:
        # The pairs of other ranks' experts go to one more expert past the last, whose
        # blocks are marked -1 like the padding blocks: the kernels skip them.
        local = expert_map[ids.to(torch.int64)]
        local = torch.where(local < 0, num_experts, local)
        sorted_pairs, block_experts = align_by_expert(local, num_experts + 1, bm)
        block_experts = torch.where(block_experts >= num_experts, -1, block_experts)
    num_blocks = block_experts.numel()
    ieee = x.dtype == torch.float32
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, bn),)](
        x, w13, h, sorted_pairs, block_experts, num_pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee)
    # Rows of skipped pairs are never written: zeros, so the sum over top-k ignores them.
    alloc = torch.empty if expert_map is None else torch.zeros
    per_pair = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks * triton.cdiv(hidden, bn),)](
        h, w2, per_pair, weights.reshape(-1).contiguous(), sorted_pairs, block_experts,
        num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        per_pair.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
