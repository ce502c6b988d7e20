"""Sliding-window attention in every kernel against one torch reference: the query at
position i sees keys i - W < j <= i (transformers' ``sliding_window_overlay``).

- the torch reference path (core/layers/paged_attention.py) against a plain masked softmax;
- the CPU backend's compiled decode and prefill kernels against it, and bit for bit against
  each other (a token's attention has the same bits whichever kernel computes it);
- the CUDA backend's Triton decode kernel and its attention layer (interpreted on a CPU).

Blocks wholly behind the window are pointed at a block full of NaN, as if the engine had
freed them and another request's garbage sat there: a kernel that reads them in place must
not let them reach the output.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from cadence.backend import ModelInput, SamplingMetadata
from cadence.layers import paged_attention as ref

# Interpreter mode is decided when a Triton function is decorated; anything that imports
# Triton's kernels earlier in the run (torch.compile's CPU tests do) must already see it,
# so it is set when this module is collected, not when its first Triton test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

WINDOWS = [1, 5, 16, 40, 300]


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
           window: int | None, scale: float) -> torch.Tensor:
    """q [Lq, H, D] at ``positions``, k/v [Lk, KVH, D] at positions 0.. -> [Lq, H, D]."""
    h, kvh = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(h // kvh, dim=1).float()
    vv = v.repeat_interleave(h // kvh, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    pos = torch.tensor(positions).view(-1, 1)
    keys = torch.arange(k.shape[0]).view(1, -1)
    allowed = keys <= pos
    if window is not None:
        allowed &= keys > pos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _sampling(b: int) -> SamplingMetadata:
    return SamplingMetadata([0.0] * b, [0] * b, [1.0] * b, [0.0] * b, [None] * b, [0] * b, True)


def _paged(seqs: list[tuple[int, int]], kvh: int, d: int, bs: int, window: int | None,
           dtype: torch.dtype, seed: int, device: str = "cpu"):
    """A step of (context_len, query_len) sequences over a paged cache with shuffled blocks.

    Returns (ModelInput, k cache, v cache, the true K/V per sequence, q, k, v of the step).
    Entries of blocks wholly behind every query's window name the last block, full of NaN.
    """
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-(c + n) // bs) for c, n in seqs)
    pool = list(range(nblocks))
    rng.shuffle(pool)
    nan_block = nblocks
    kc = torch.zeros((nblocks + 1) * bs, kvh, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[nan_block * bs:] = float("nan")
    vc[nan_block * bs:] = float("nan")
    tables, true_kv, slots, qs, ks, vs, positions = [], [], [], [], [], [], []
    h = 4 * kvh
    for c, n in seqs:
        total = c + n
        table = [pool.pop() for _ in range(-(-total // bs))]
        keys = torch.randn(total, kvh, d, generator=g).to(dtype)
        vals = torch.randn(total, kvh, d, generator=g).to(dtype)
        pos = torch.arange(c)  # the cached context is in the cache before the step
        cslots = torch.tensor(table)[pos // bs] * bs + pos % bs
        kc[cslots], vc[cslots] = keys[:c], vals[:c]
        true_kv.append((keys, vals))
        ks.append(keys[c:])
        vs.append(vals[c:])
        qs.append(torch.randn(n, h, d, generator=g).to(dtype))
        positions.extend(range(c, total))
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, total))
        if window is not None:
            dead = max(0, c + 1 - window) // bs  # wholly before the first query's window
            table = [nan_block] * dead + table[dead:]
        tables.append(table)
    b = len(seqs)
    nd = sum(1 for c, n in seqs if n == 1 and c > 0)
    assert all(n == 1 and c > 0 for c, n in seqs[:nd]), "decodes first"
    mi = ModelInput([0] * len(positions), positions, slots, [n for _, n in seqs],
                    [c + n for c, n in seqs], tables, nd, list(range(b)), _sampling(b))
    return (mi, kc.to(device), vc.to(device), true_kv, torch.cat(qs).to(device),
            torch.cat(ks).to(device), torch.cat(vs).to(device))


def _expected(mi: ModelInput, true_kv, q: torch.Tensor, window: int | None,
              scale: float) -> torch.Tensor:
    out, start = [], 0
    for (keys, vals), n, total in zip(true_kv, mi.query_lens, mi.seq_lens):
        out.append(_naive(q[start:start + n].cpu(), keys, vals, list(range(total - n, total)),
                          window, scale))
        start += n
    return torch.cat(out)


MIXED = [(40, 1), (7, 1), (300, 1), (0, 37), (0, 3), (21, 30), (260, 20)]


@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_torch_reference_path_honours_the_window(window) -> None:
    d, kvh, bs = 16, 2, 8
    mi, kc, vc, true_kv, q, k, v = _paged(MIXED, kvh, d, bs, window, torch.float32, seed=1)
    attn = ref.TorchPagedAttention([kc], [vc], d ** -0.5)
    # The torch decode path gathers whole tables and masks; with NaN there a masked 0 * NaN
    # would poison the row, so it runs on the finite cache (freed blocks hold finite K/V).
    kc.nan_to_num_(0.0)
    vc.nan_to_num_(0.0)
    md = ref.build_metadata(mi, bs)
    out = attn.forward(0, q, k, v, md, sliding_window=window)
    torch.testing.assert_close(out, _expected(mi, true_kv, q, window, d ** -0.5),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the CPU backend's compiled kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_kernels_honour_the_window(ops, window, dtype) -> None:
    from cadence.backends.cpu.attention import CpuPagedAttention

    d, kvh, bs = 32, 2, 8
    mi, kc, vc, true_kv, q, k, v = _paged(MIXED, kvh, d, bs, window, dtype, seed=2)
    attn = CpuPagedAttention(ops, [kc], [vc], bs, d ** -0.5)
    from cadence.backends.cpu.attention import build_metadata

    out = attn.forward(0, q, k, v, build_metadata(mi, bs), sliding_window=window)
    assert not out.isnan().any(), "a block behind the window was read"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), _expected(mi, true_kv, q, window, d ** -0.5),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 17, 256, 300])
def test_windowed_prefill_rows_have_the_decode_kernels_bits(ops, dtype, window) -> None:
    """A prompt row equals the decode kernel's output for that token under the same window,
    bit for bit, so a recompute after preemption changes nothing (async on == off)."""
    d, h, kvh, bs, n = 64, 9, 3, 16, 600
    g = torch.Generator().manual_seed(window)
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=g).to(dtype)
    q, k, v = (x.view(n, -1, d) for x in qkv.split([h * d, kvh * d, kvh * d], dim=-1))
    out = torch.zeros(n, h, d, dtype=dtype)
    ops.prefill_attention(q, k, v, out, torch.tensor([0]), torch.tensor([n]), d ** -0.5,
                          window)
    nb = -(-n // bs)
    table = torch.randperm(nb, generator=g)
    kc = torch.zeros(nb * bs, kvh, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb)
    kc[slots[:n]], vc[slots[:n]] = k, v
    decode = ops.paged_decode_attention(
        q.contiguous(), kc.view(-1, bs, kvh, d), vc.view(-1, bs, kvh, d),
        table.int().expand(n, nb).contiguous(), torch.arange(1, n + 1, dtype=torch.int32),
        d ** -0.5, window)
    assert torch.equal(out, decode), f"{(out != decode).sum().item()} values differ"
    want = _naive(q, k, v, list(range(n)), window, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_a_window_wider_than_the_context_changes_no_bit(ops) -> None:
    d, kvh, bs = 16, 2, 16
    mi, kc, vc, _, q, k, v = _paged(MIXED, kvh, d, bs, None, torch.float32, seed=3)
    from cadence.backends.cpu.attention import CpuPagedAttention, build_metadata

    attn = CpuPagedAttention(ops, [kc], [vc], bs, d ** -0.5)
    full = attn.forward(0, q, k, v, build_metadata(mi, bs))
    wide = attn.forward(0, q, k, v, build_metadata(mi, bs), sliding_window=10_000)
    assert torch.equal(full, wide)


# --------------------------------------------------------------------------------------------
# the CUDA backend's Triton kernels, interpreted on a CPU


@pytest.fixture(scope="module")
def triton_kernels():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from cadence.backends.cuda import triton_kernels as tk

    return tk


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_triton_attention_honours_the_window(triton_kernels, window) -> None:
    from cadence.backends.cuda.attention import CudaAttentionMetadata, TritonPagedAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    d, kvh, bs = 16, 2, 8
    seqs = [(40, 1), (7, 1), (90, 1), (0, 37), (21, 30)]
    mi, kc, vc, true_kv, q, k, v = _paged(seqs, kvh, d, bs, window, torch.float32, seed=4,
                                          device=device)
    md_ref = ref.build_metadata(mi, bs, device)
    nd = mi.num_decodes
    width = max(len(t) for t in mi.block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in mi.block_tables],
                          dtype=torch.int32, device=device)
    md = CudaAttentionMetadata(md_ref.slot_mapping, nd, tables[:nd],
                               torch.tensor(mi.seq_lens[:nd], dtype=torch.int32,
                                            device=device), md_ref.prefills)
    attn = TritonPagedAttention([kc], [vc], d ** -0.5, bs, kernels=triton_kernels)
    out = attn.forward(0, q, k, v, md, sliding_window=window)
    assert not out.isnan().any(), "a block behind the window was read"
    torch.testing.assert_close(out.cpu(), _expected(mi, true_kv, q, window, d ** -0.5),
                               rtol=1e-4, atol=1e-4)
