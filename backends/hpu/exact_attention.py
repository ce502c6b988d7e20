"""Attention whose every query row has the same bits whatever step computes it, for the
HPU emulation on CPU tensors.

NOTE exactness: the engine's guarantee "async on == off, async scheduling == sync" needs a
token's attention output to depend only on its own query and its sequence's cache. On a
Gaudi that is the hardware's business; the emulation runs the same graphs on the CPU,
where the three paths of ``attention.py`` reach different CPU GEMM kernels: decode
(a batched GEMM of G query rows), prefill with context (of Q * G rows) and a fresh prefill
(torch SDPA), and even decode alone picked another kernel for a batch of 1 than of 2.
Whenever two runs put a token in different paths, its last bits differed: async
scheduling legitimately changes when a request is preempted and recomputed (its first
generated token then goes through prefill with context instead of decode), and the
seeded conformance workload saw a logprob move by 1e-4 (measured on an AVX2 AMD EPYC).

So the emulation computes every path the same way: keys read from the cache (a fresh
chunk's too, so rounding to the cache dtype is the same), padded with masked keys to one
fixed length (the longest sequence the engine serves), scores and weighted sums as
elementwise products reduced over a contiguous last dimension of fixed size. Each output
is then one reduction of the same length in the same order, whichever rows, batch or
path surround it. The price: every row reads max_model_len keys whatever its length, and
its products take heads x keys x head_dim floats, so sequences and rows go in chunks of
about 64 MiB of products; fine for the emulation's small models, never run on a Gaudi.
"""

from __future__ import annotations

import torch

# Elements of one product tensor: about 64 MiB of fp32 (at least one query row).
_CHUNK_ELEMENTS = 1 << 24


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, key_len: int, soft_cap: float | None = None) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, L, KVH, D], mask [B, Q, L] (True = attend) -> [B, Q, H, D] in
    q's dtype, each row independent of B, Q and L (module NOTE).

    Keys are cut or padded to ``key_len``: a bucket may gather more blocks than the longest
    sequence has, and those keys (index >= max_model_len) are never a real row's."""
    b, ql, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    if length > key_len:
        k, v, mask = k[:, :key_len], v[:, :key_len], mask[:, :, :key_len]
    elif length < key_len:
        pad = key_len - length
        k = torch.cat([k, k.new_zeros(b, pad, kvh, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, pad, kvh, d)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, ql, pad)], dim=2)
    length = key_len
    g = h // kvh
    kt = k.float().permute(0, 2, 1, 3).contiguous()  # [B, KVH, L, D]
    vt = v.float().permute(0, 2, 3, 1).contiguous()  # [B, KVH, D, L]
    qg = q.float().view(b, ql, kvh, g, d)
    # Chunks of sequences and of query rows: one query row's products are h * L * d.
    per_row = h * length * d
    seqs = max(1, min(b, _CHUNK_ELEMENTS // per_row))
    rows = max(1, _CHUNK_ELEMENTS // (seqs * per_row))
    out = torch.empty(b, ql, kvh, g, d, device=q.device)
    for s0 in range(0, b, seqs):
        kc, vc = kt[s0:s0 + seqs, None, :, None], vt[s0:s0 + seqs, None, :, None]
        for r0 in range(0, ql, rows):
            qc = qg[s0:s0 + seqs, r0:r0 + rows]  # [S, R, KVH, G, D]
            scores = (qc.unsqueeze(4) * kc).sum(-1) * scale  # [S, R, KVH, G, L]
            if soft_cap is not None:
                scores = torch.tanh(scores / soft_cap) * soft_cap
            keep = mask[s0:s0 + seqs, r0:r0 + rows].unsqueeze(2).unsqueeze(3)
            probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            out[s0:s0 + seqs, r0:r0 + rows] = (probs.unsqueeze(4) * vc).sum(-1)
    return out.reshape(b, ql, h, d).to(q.dtype)
