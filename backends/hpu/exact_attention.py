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
path surround it. It costs memory of rows x heads x keys x head_dim per chunk of rows, so
rows go in chunks; fine for the emulation's tiny models, and never run on a Gaudi.
"""

from __future__ import annotations

import torch

# Elements of one product tensor: about 64 MiB of fp32 per chunk of query rows.
_CHUNK_ELEMENTS = 1 << 24


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, key_len: int, soft_cap: float | None = None) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, L, KVH, D] (L <= key_len), mask [B, Q, L] (True = attend)
    -> [B, Q, H, D] in q's dtype, each row independent of B, Q and L (module NOTE)."""
    b, ql, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    pad = max(key_len, length) - length
    if pad:
        k = torch.cat([k, k.new_zeros(b, pad, kvh, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, pad, kvh, d)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, ql, pad)], dim=2)
    length += pad
    g = h // kvh
    kt = k.float().permute(0, 2, 1, 3).contiguous()  # [B, KVH, L, D]
    vt = v.float().permute(0, 2, 3, 1).contiguous()  # [B, KVH, D, L]
    qg = q.float().view(b, ql, kvh, g, d)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * h * length * d))
    out = []
    for s in range(0, ql, rows):
        qc = qg[:, s:s + rows]  # [B, R, KVH, G, D]
        scores = (qc.unsqueeze(4) * kt[:, None, :, None]).sum(-1) * scale  # [B, R, KVH, G, L]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        keep = mask[:, s:s + rows].view(b, -1, 1, 1, length)
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out.append((probs.unsqueeze(4) * vt[:, None, :, None]).sum(-1))  # [B, R, KVH, G, D]
    return torch.cat(out, dim=1).reshape(b, ql, h, d).to(q.dtype)
