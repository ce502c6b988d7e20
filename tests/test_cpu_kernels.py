"""The CPU backend's compiled kernels (backends/cpu/csrc) against the torch reference code,
plus the pieces around them: packed GEMMs, the GEMM choice, the two-level inverse-CDF
sampler, the build cache and the fallbacks when no kernel can be built.

The kernel module is built once per machine and cached (~45 s the first time, ~1 s later).
Bitwise checks (``torch.equal``) are on purpose: the engine's async == sync exactness needs
a row's bits to be independent of the batch and of the thread count.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from types import SimpleNamespace

import model_factory
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.backend import ModelInput, SamplingMetadata
from cadence.backends.cpu import attention as cpu_attention
from cadence.backends.cpu import gated, kernels
from cadence.backends.cpu import linear as cpu_linear
from cadence.backends.cpu import linear_choice as cpu_choice
from cadence.backends.cpu import runtime as cpu_runtime
from cadence.backends.cpu.fused import KernelRMSNorm, KernelRotary, KernelSiluAndMul
from cadence.backends.cpu.gated import TiledGatedLinear
from cadence.cpuinfo import CpuInfo, cpu_info
from cadence.layers import paged_attention as ref
from cadence.layers.activation import SiluAndMul
from cadence.layers.linear import Linear
from cadence.layers.norm import RMSNorm
from cadence.layers.rotary import RotaryEmbedding, apply_rotary
from cadence.layers.sampler import inverse_cdf

KERNEL_LOGGER = "cadence.backends.cpu.kernels"


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors of the same signs (ordered bits)."""
    ai = a.float().view(torch.int32).long()
    bi = b.float().view(torch.int32).long()
    return (ai - bi).abs() >> 16


# --------------------------------------------------------------------------------------------
# paged decode attention


def _sampling(b: int) -> SamplingMetadata:
    return SamplingMetadata([0.0] * b, [0] * b, [1.0] * b, [0.0] * b, [None] * b, [0] * b, True)


def _decode_step(seq_lens: list[int], block_size: int, rng: random.Random,
                 spare: int = 3) -> tuple[ModelInput, int]:
    """A decode-only step whose sequences own blocks drawn from a shuffled pool, so tables
    are random permutations and neighbouring blocks belong to other sequences."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, seq_lens)]
    b = len(seq_lens)
    mi = ModelInput([0] * b, [n - 1 for n in seq_lens], slots, [1] * b, list(seq_lens), tables,
                    b, list(range(b)), _sampling(b))
    return mi, num_blocks


def _random_caches(num_slots: int, kvh: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, kvh, d, generator=g).to(dtype)
    v = torch.randn(num_slots, kvh, d, generator=g).to(dtype)
    return k, v


def _kernel_decode(ops, q, kc, vc, mi: ModelInput, block_size: int, scale: float):
    md = cpu_attention.build_metadata(mi, block_size)
    kvh, d = kc.shape[1:]
    return ops.paged_decode_attention(q, kc.view(-1, block_size, kvh, d),
                                      vc.view(-1, block_size, kvh, d), md.kernel_tables,
                                      md.kernel_lens, scale)


def _reference_decode(q, kc, vc, mi: ModelInput, block_size: int, scale: float):
    md = ref.build_metadata(mi, block_size)
    return ref.decode_attention(q, kc, vc, md.decode_tables, md.decode_mask, scale)


MIXED_LENS = [1, 16, 37, 700, 5, 1100, 256, 257]  # several 256-token partitions among short ones

ATTENTION_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens)
    *[(8, 2, d, 16, MIXED_LENS) for d in (16, 32, 64, 128, 256)],
    (4, 4, 64, 16, MIXED_LENS),  # group 1 (MHA)
    (6, 2, 64, 8, MIXED_LENS),  # group 3
    (8, 2, 32, 32, MIXED_LENS),  # group 4
    (8, 1, 64, 16, MIXED_LENS),  # MQA
    (4, 1, 128, 32, [1, 32, 33, 64]),  # exactly one block, one token into the next
    (4, 2, 16, 8, [8, 9, 1, 15]),  # small blocks, partly filled last ones
    (16, 2, 128, 16, [3000]),  # batch 1, long context: all threads on one sequence
]


def _case_id(case) -> str:
    h, kvh, d, bs, lens = case
    return f"h{h}-kv{kvh}-d{d}-bs{bs}-n{len(lens)}x{max(lens)}"


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_decode_attention_matches_reference_fp32(ops, case) -> None:
    h, kvh, d, bs, lens = case
    rng = random.Random(sum(map(ord, _case_id(case))))
    mi, num_blocks = _decode_step(lens, bs, rng)
    kc, vc = _random_caches(num_blocks * bs, kvh, d, torch.float32, seed=rng.randrange(1 << 30))
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    out = _kernel_decode(ops, q, kc, vc, mi, bs, scale)
    expected = _reference_decode(q, kc, vc, mi, bs, scale)
    assert out.dtype == torch.float32 and out.shape == (len(lens), h, d)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # A sequence of one token attends to that token alone: its output is its V row.
    for i, n in enumerate(lens):
        if n == 1:
            slot = mi.block_tables[i][0] * bs
            torch.testing.assert_close(out[i], vc[slot].repeat_interleave(h // kvh, dim=0),
                                       atol=1e-6, rtol=0)


# head_dim 16 and 128, group 3, MQA, batch 1 with a long context
BF16_CASES = [ATTENTION_CASES[i] for i in (0, 3, 6, 8, 11)]


@pytest.mark.parametrize("case", BF16_CASES, ids=_case_id)
def test_decode_attention_matches_reference_bf16(ops, case) -> None:
    h, kvh, d, bs, lens = case
    rng = random.Random(7)
    mi, num_blocks = _decode_step(lens, bs, rng)
    kc, vc = _random_caches(num_blocks * bs, kvh, d, torch.bfloat16, seed=3)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(2)).bfloat16()
    scale = d ** -0.5
    out = _kernel_decode(ops, q, kc, vc, mi, bs, scale)
    assert out.dtype == torch.bfloat16
    # Exact maths on the same bf16 inputs: the kernel accumulates in fp32 and rounds once,
    # so it is within one bf16 step (2^-8 relative) of the float64 answer.
    exact = _reference_decode(q.double(), kc.double(), vc.double(), mi, bs, scale)
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-6)
    # torch's bf16 SDPA rounds intermediates too, so the two differ by a few bf16 steps.
    torch.testing.assert_close(out, _reference_decode(q, kc, vc, mi, bs, scale),
                               rtol=2 ** -6, atol=2 ** -7)
    # fp32 queries over a bf16 cache (the kernel takes any mix): fp32 out, fp32 accuracy.
    out32 = _kernel_decode(ops, q.float(), kc, vc, mi, bs, scale)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-5)


# (tokens in the cache before this step, tokens this step); the first num_decodes are decodes.
MIXED_STEPS = {
    # decodes, a chunk with cached context, a fresh prompt: kernel rows q[:n], then a prefill
    "decode_context_fresh": ([(0, 1), (39, 1), (299, 1), (20, 13), (0, 9)], 3),
    # chunks with cached context on both sides of a fresh prompt: kernel rows gathered
    "context_fresh_context": ([(0, 1), (16, 5), (0, 7), (40, 17), (3, 1), (0, 4)], 1),
    # prefix-cache hits only (no decodes, no fresh prompt), one of them crossing a 256-key
    # partition: one call gives the whole output
    "context_only": ([(112, 16), (112, 16), (97, 3), (5, 40), (230, 70)], 0),
}


@pytest.mark.parametrize("name", sorted(MIXED_STEPS))
def test_attention_impls_agree_on_a_mixed_decode_and_prefill_step(ops, name) -> None:
    """CpuPagedAttention (all kernels) against TorchPagedAttention on one step mixing decodes,
    prefill chunks with cached context and fresh prompts."""
    seqs, num_decodes = MIXED_STEPS[name]
    h, kvh, d, bs = 8, 2, 32, 16
    rng = random.Random(5)
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    positions, slots = [], []
    for (ctx, n), table in zip(seqs, tables):
        for p in range(ctx, ctx + n):
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    t = len(positions)
    mi = ModelInput([0] * t, positions, slots, [n for _, n in seqs], [c + n for c, n in seqs],
                    tables, num_decodes, list(range(len(seqs))), _sampling(len(seqs)))
    kc, vc = _random_caches(num_blocks * bs, kvh, d, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, kvh, kvh))
    kc2, vc2 = kc.clone(), vc.clone()
    torch_impl = ref.TorchPagedAttention([kc], [vc], d ** -0.5)
    kernel_impl = cpu_attention.CpuPagedAttention(ops, [kc2], [vc2], bs, d ** -0.5)
    expected = torch_impl.forward(0, q, k, v, ref.build_metadata(mi, bs))
    md = cpu_attention.build_metadata(mi, bs)
    out = kernel_impl.forward(0, q, k, v, md)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # Every decode and every row of a chunk with cached context went through the decode
    # kernel in one call, and has the bits a decode of that position alone would have (what
    # keeps async == sync exact when a recompute after preemption replaces decodes).
    kernel_rows, start = [], 0
    for i, (ctx, n) in enumerate(seqs):
        if i < num_decodes or ctx:
            kernel_rows += [(start + j, i, ctx + j + 1) for j in range(n)]
        start += n
    assert md.num_kernel_rows == len(kernel_rows)
    assert (md.kernel_rows is None) == (name != "context_fresh_context")
    for row, i, length in kernel_rows:
        alone = ops.paged_decode_attention(
            q[row:row + 1], kc2.view(-1, bs, kvh, d), vc2.view(-1, bs, kvh, d),
            torch.tensor([tables[i]], dtype=torch.int32),
            torch.tensor([length], dtype=torch.int32), d ** -0.5)
        assert torch.equal(out[row], alone[0]), (row, i)
    # The kernel read the token written this step (a stale cache would not match).
    assert torch.equal(kc2[slots[1]], k[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_batch_and_thread_invariant(ops, restore_threads, dtype) -> None:
    h, kvh, d, bs = 8, 2, 64, 16
    lens = [700, 1, 37, 1100, 16, 300, 5, 257]
    rng = random.Random(0)
    mi, num_blocks = _decode_step(lens, bs, rng)
    kc, vc = _random_caches(num_blocks * bs, kvh, d, dtype, seed=0)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(0)).to(dtype)
    kvh_blocks = (kc.view(-1, bs, kvh, d), vc.view(-1, bs, kvh, d))

    def run(idx: list[int], extra_columns: int = 0) -> torch.Tensor:
        width = max(len(mi.block_tables[i]) for i in idx) + extra_columns
        tables = torch.tensor([mi.block_tables[i] + [0] * (width - len(mi.block_tables[i]))
                               for i in idx], dtype=torch.int32)
        seq_lens = torch.tensor([lens[i] for i in idx], dtype=torch.int32)
        return ops.paged_decode_attention(q[idx], *kvh_blocks, tables, seq_lens, d ** -0.5)

    torch.set_num_threads(2)
    everything = list(range(len(lens)))
    batch = run(everything)
    reverse = run(everything[::-1])
    # Many sequences: the kernel then groups all KV heads of a partition into one item.
    crowd = run([3] * 24 + [1])
    torch.set_num_threads(1)
    batch_1t = run(everything)
    for i in everything:
        alone = run([i])
        assert torch.equal(alone[0], batch[i]), f"sequence {i}: alone != in the batch"
        assert torch.equal(reverse[len(lens) - 1 - i], batch[i]), f"sequence {i}: index"
        assert torch.equal(run([i], extra_columns=5)[0], batch[i]), f"sequence {i}: padding"
        assert torch.equal(batch_1t[i], batch[i]), f"sequence {i}: 1 thread != 2 threads"
    assert torch.equal(crowd[0], batch[3]) and torch.equal(crowd[-1], batch[1])


def test_decode_attention_empty_sequence_gives_zeros(ops) -> None:
    bs, kvh, d = 16, 2, 32
    mi, num_blocks = _decode_step([37, 300], bs, random.Random(4))
    kc, vc = _random_caches(num_blocks * bs, kvh, d, torch.float32, seed=4)
    md = cpu_attention.build_metadata(mi, bs)
    q = torch.randn(2, 4, d)
    args = (kc.view(-1, bs, kvh, d), vc.view(-1, bs, kvh, d), md.kernel_tables)
    full = ops.paged_decode_attention(q, *args, md.kernel_lens, d ** -0.5)
    lens = md.kernel_lens.clone()
    lens[0] = 0
    out = ops.paged_decode_attention(q, *args, lens, d ** -0.5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1], full[1])


def test_decode_attention_rejects_bad_input(ops) -> None:
    bs, kvh, d = 16, 2, 64
    mi, num_blocks = _decode_step([37], bs, random.Random(0))
    kc, vc = _random_caches(num_blocks * bs, kvh, d, torch.float32, seed=0)
    kb, vb = kc.view(-1, bs, kvh, d), vc.view(-1, bs, kvh, d)
    md = cpu_attention.build_metadata(mi, bs)
    q = torch.randn(1, 4, d)
    tables, lens = md.kernel_tables, md.kernel_lens
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32  # what build_metadata makes
    ops.paged_decode_attention(q, kb, vb, tables, lens, 1.0)  # the valid call runs

    with pytest.raises(RuntimeError, match="must be int32"):
        ops.paged_decode_attention(q, kb, vb, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="must be int32"):
        ops.paged_decode_attention(q, kb, vb, tables, lens.long(), 1.0)
    too_long = torch.tensor([tables.shape[1] * bs + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops.paged_decode_attention(q, kb, vb, tables, too_long, 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops.paged_decode_attention(q, kb, vb, tables, torch.tensor([-1], dtype=torch.int32), 1.0)
    c80 = torch.zeros(num_blocks, bs, kvh, 80)
    with pytest.raises(RuntimeError, match="head_dim must be one of 16, 32, 64, 128, 256"):
        ops.paged_decode_attention(torch.randn(1, 4, 80), c80, c80, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        ops.paged_decode_attention(q.half(), kb, vb, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="KV cache must be float32 or bfloat16"):
        ops.paged_decode_attention(q, kb.half(), vb.half(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        ops.paged_decode_attention(q, kb, vb.bfloat16(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        ops.paged_decode_attention(torch.randn(1, 3, d), kb, vb, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="head_dim of q and the cache differ"):
        ops.paged_decode_attention(torch.randn(1, 4, 32), kb, vb, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
        ops.paged_decode_attention(q, kb.transpose(2, 3), vb.transpose(2, 3), tables, lens, 1.0)


def test_kernel_support_and_attention_choice(ops, caplog) -> None:
    assert cpu_attention.kernel_supports(64, torch.bfloat16) is None
    assert "head_dim 80" in cpu_attention.kernel_supports(80, torch.float32)
    assert "float16" in cpu_attention.kernel_supports(64, torch.float16)
    with pytest.raises(ValueError, match="head_dim 80"):
        cpu_runtime._choose_attention("kernel", 80, torch.float32)
    with pytest.raises(ValueError, match=r"\('auto', 'kernel', 'torch'\)"):
        cpu_runtime._choose_attention("fast", 64, torch.float32)
    assert cpu_runtime._choose_attention("torch", 64, torch.float32) == (None, "torch")
    assert cpu_runtime._choose_attention("kernel", 64, torch.float32) == (ops, "kernel")
    with caplog.at_level(logging.WARNING, logger="cadence.backends.cpu.runtime"):
        assert cpu_runtime._choose_attention("auto", 80, torch.float32) == (None, "torch")
    records = [r for r in caplog.records if r.name == "cadence.backends.cpu.runtime"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "head_dim 80" in records[0].getMessage()


# --------------------------------------------------------------------------------------------
# fused RMSNorm / SiLU-and-mul / rotary


def _qkv_views(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, seed: int):
    """q [T, H, D] and k [T, KVH, D] as the model makes them: strided views of one fused
    qkv output, with v after them in each row."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    return qkv, q.view(t, h, d), k.view(t, kvh, d), v


def _norm(n: int, dtype: torch.dtype, seed: int, unit: bool = False) -> RMSNorm:
    norm = RMSNorm(n, eps=1e-6).to(dtype)
    if not unit:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return norm


def _rms_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(*shape, generator=g) * 3).to(dtype)
            for shape in [(37, 64), (5, 72), (1, 8), (300, 576), (4, 3, 32), (2, 1, 128)]]
    wide = (torch.randn(9, 100, generator=g) * 3).to(dtype)
    rows.append(wide[:, :72])  # row stride 100, width 72: read in place, not copied
    _, q, k, _ = _qkv_views(11, 4, 2, 32, dtype, seed=1)
    return [*rows, q, k]  # Qwen3's per-head q/k norm: 3-D, non-contiguous


def test_rms_norm_fp32(ops) -> None:
    for i, x in enumerate(_rms_inputs(torch.float32)):
        norm = _norm(x.shape[-1], torch.float32, seed=i)
        before = x.clone()
        with torch.no_grad():
            out = ops.rms_norm(x, norm.weight, norm.eps)
            expected = norm(x)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(x, before)


def test_rms_norm_bf16_within_one_step_before_the_weight(ops) -> None:
    """Both paths round x * rsqrt(mean) to bf16 before the weight; the kernel's sum of
    squares runs in another order, so that rounding may land one bf16 step away (rarely).
    A weight above 1 can stretch that step to two steps of the output."""
    differing = total = 0
    for i, x in enumerate(_rms_inputs(torch.bfloat16)):
        for unit in (True, False):
            norm = _norm(x.shape[-1], torch.bfloat16, seed=i, unit=unit)
            with torch.no_grad():
                out = ops.rms_norm(x, norm.weight, norm.eps)
                expected = norm(x)
            assert out.dtype == torch.bfloat16 and out.shape == x.shape
            steps = _bf16_ulps(out, expected)
            assert steps.max() <= (1 if unit else 2)
            differing += int((steps > 0).sum())
            total += steps.numel()
    assert differing <= total * 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(64, 576), (37, 130), (1, 16), (5, 7)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(ops, dtype, rows, n) -> None:
    """The fused op leaves the residual stream exactly as ``x + residual`` (same rounding)
    and the normalised sum as RMSNorm computes it, both in place; the KernelRMSNorm module
    gives the core norm's (hidden, residual) pair."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    residual = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    norm = _norm(n, dtype, seed=n)
    with torch.no_grad():
        expected_out, expected_sum = norm(x.clone(), residual.clone())
        kernel = KernelRMSNorm(ops, norm)
        xi, ri = x.clone(), residual.clone()
        out, summed = kernel(xi, ri)
    assert out.data_ptr() == xi.data_ptr() and summed.data_ptr() == ri.data_ptr()
    assert torch.equal(summed, expected_sum)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    else:
        assert _bf16_ulps(out, expected_out).max() <= 2
    with torch.no_grad():  # a non-contiguous input is copied, never misread
        wide = torch.cat([x, x], dim=1)[:, :n]
        out2, summed2 = kernel(wide, residual.clone())
    assert torch.equal(summed2, expected_sum)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.add_rms_norm(x.float(), residual.float(), norm.weight.double(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 600])
def test_write_kv_matches_index_copy_on_strided_views(ops, dtype, tokens) -> None:
    """k and v arrive as views of the fused qkv output (token stride > row): the rows land
    in the slots exactly as the torch path's index_copy_ puts them, nothing else changes."""
    kvh, d, num_slots = 3, 64, 2048
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 * d + 2 * kvh * d, generator=g).to(dtype)
    k = qkv[:, 9 * d: 9 * d + kvh * d].view(tokens, kvh, d)
    v = qkv[:, 9 * d + kvh * d:].view(tokens, kvh, d)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    kc, vc = torch.randn(num_slots, kvh, d).to(dtype), torch.randn(num_slots, kvh, d).to(dtype)
    ek, ev = kc.clone(), vc.clone()
    ek.index_copy_(0, slots, k)
    ev.index_copy_(0, slots, v)
    ops.write_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv(kc, vc, k, v, torch.full((tokens,), num_slots, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.write_kv(kc.double(), vc.double(), k, v, slots)


def test_rms_norm_rejects_mixed_dtypes_and_fp16(ops) -> None:
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="x and weight dtypes differ"):
        ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="only float32 and bfloat16"):
        ops.rms_norm(x.half(), torch.ones(16, dtype=torch.half), 1e-6)


SILU_SHAPES = [(37, 128), (5, 144), (3, 2), (64, 3072), (300, 256), (1, 34)]


def test_silu_and_mul_fp32(ops) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in SILU_SHAPES:
        x = torch.randn(*shape, generator=g) * 6
        out = ops.silu_and_mul(x)
        assert out.shape == (shape[0], shape[1] // 2)
        torch.testing.assert_close(out, SiluAndMul()(x), atol=1e-6, rtol=1e-6)
    # A non-contiguous input (a column slice) is read correctly.
    wide = torch.randn(7, 200, generator=g)
    torch.testing.assert_close(ops.silu_and_mul(wide[:, :144]), SiluAndMul()(wide[:, :144]),
                               atol=1e-6, rtol=1e-6)


def test_silu_and_mul_bf16_within_one_step(ops) -> None:
    """The kernel rounds silu(gate) to bf16 before the product, as torch does; only its exp
    differs (a polynomial), which can move a rounding by one step. Measured here: none."""
    g = torch.Generator().manual_seed(1)
    differing = total = 0
    for shape in SILU_SHAPES:
        x = (torch.randn(*shape, generator=g) * 6).bfloat16()
        out = ops.silu_and_mul(x)
        steps = _bf16_ulps(out, SiluAndMul()(x))
        assert steps.max() <= 1
        differing += int((steps > 0).sum())
        total += steps.numel()
    assert differing <= total * 1e-4


def test_silu_of_very_negative_gates_is_zero_to_float_precision(ops) -> None:
    # The vector exp clamps its argument at 88, so silu(-100) is ~-6e-37 there while torch
    # (and the kernel's scalar tail) give -0.0: a difference no later op can see.
    x = torch.cat([torch.full((2, 17), -100.0), torch.ones(2, 17)], dim=1)
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    assert out.abs().max() < 1e-30
    torch.testing.assert_close(out, SiluAndMul()(x), atol=1e-30, rtol=0)


def test_silu_and_mul_rejects_odd_width(ops) -> None:
    with pytest.raises(RuntimeError, match=r"x must be \[T, 2 \* n\]"):
        ops.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match=r"x must be \[T, 2 \* n\]"):
        ops.silu_and_mul(torch.randn(2, 3, 4))


def _cos_sin(d: int, positions: torch.Tensor, dtype: torch.dtype):
    config = SimpleNamespace(max_position_embeddings=512,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return RotaryEmbedding(config, d, 512, dtype)(positions)


ROTARY_CASES = [  # (tokens, heads, kv heads, head_dim): halves around 8 and 16 lanes
    (7, 4, 2, 16), (13, 8, 2, 64), (3, 4, 4, 128), (5, 3, 1, 24), (40, 4, 2, 32), (6, 2, 1, 48),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_inplace_matches_apply_rotary(ops, dtype) -> None:
    for i, (t, h, kvh, d) in enumerate(ROTARY_CASES):
        qkv, q, k, v = _qkv_views(t, h, kvh, d, dtype, seed=i)
        positions = torch.randint(0, 512, (t,), generator=torch.Generator().manual_seed(i))
        cos_sin = _cos_sin(d, positions, dtype)
        exp_q, exp_k = apply_rotary(q, k, cos_sin)
        v_before = v.clone()
        ops.rotary_inplace(q, k, *cos_sin)
        if dtype == torch.bfloat16:
            # Each product is rounded where torch rounds it and there is no transcendental:
            # the same bits.
            assert torch.equal(q, exp_q) and torch.equal(k, exp_k), (t, h, kvh, d)
        else:
            torch.testing.assert_close(q, exp_q, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(k, exp_k, atol=1e-6, rtol=1e-6)
        assert torch.equal(v, v_before)  # its neighbour in the fused row is untouched
        # The rotation landed in the fused tensor itself (in place, through the views).
        assert torch.equal(qkv[:, : h * d].view(t, h, d), q)


def test_rotary_rejects_bad_input(ops) -> None:
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    cos, sin = _cos_sin(16, torch.arange(3), torch.float32)
    with pytest.raises(RuntimeError, match="one cos/sin row per token"):
        ops.rotary_inplace(q, k, cos[:2], sin[:2])
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.rotary_inplace(q, k, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
        ops.rotary_inplace(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ops.rotary_inplace(torch.randn(3, 2, 15), torch.randn(3, 1, 15),
                           torch.randn(3, 15), torch.randn(3, 15))


# --------------------------------------------------------------------------------------------
# inverse-CDF sampling


def _searchsorted_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, u.double() * cdf[:, -1:]).squeeze(1).clamp(
        max=probs.shape[1] - 1)


def _cdf_gap(probs: torch.Tensor, u: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """How far (in mass) each row's target u * total lies outside the CDF interval of the
    token returned for it; 0 when the token is exactly the right one."""
    cdf = probs.double().cumsum(dim=-1)
    target = u.double() * cdf[:, -1:]
    hi = cdf.gather(1, idx.unsqueeze(1))
    lo = hi - probs.double().gather(1, idx.unsqueeze(1))
    return torch.maximum(lo - target, target - hi).clamp(min=0).squeeze(1)


def _masked_probs(b: int, v: int, g: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(torch.randn(b, v, generator=g) * 3, dim=-1)
    mask = torch.rand(b, v, generator=g) < 0.5
    mask[:, 255:v:256] = True  # the last token of every chunk
    mask[::2, 256:512] = True  # a whole chunk
    mask[1::3, -1] = True  # the last token of the vocabulary
    mask[::5, 768:] = True  # every chunk after the third
    mask[:, 0] = False  # at least one token with mass per row
    return probs.masked_fill(mask, 0.0)


def test_inverse_cdf_agrees_with_cumsum_searchsorted() -> None:
    g = torch.Generator().manual_seed(0)
    agree = total = 0
    for v in (1000, 4096, 255, 257):
        probs = torch.softmax(torch.randn(64, v, generator=g) * 2, dim=-1)
        u = 1.0 - torch.rand(64, 1, generator=g)  # as the sampler draws it: (0, 1]
        idx = inverse_cdf(probs, u)
        assert idx.shape == (64,) and idx.dtype == torch.int64
        agree += int((idx == _searchsorted_reference(probs, u)).sum())
        total += 64
        # Where they differ it is a rounding tie at a token boundary, never a wrong region.
        assert _cdf_gap(probs, u, idx).max() < 1e-6
    assert agree >= 0.99 * total


def test_inverse_cdf_never_returns_a_zero_probability_token() -> None:
    g = torch.Generator().manual_seed(1)
    b = 512  # rows are independent: many rows per call is many cases per call
    for v in (1000, 1024, 300):
        for _ in range(2):
            probs = _masked_probs(b, v, g)
            draws = [1.0 - torch.rand(b, 1, generator=g), torch.ones(b, 1),
                     torch.full((b, 1), 2.0 ** -24), torch.full((b, 1), 1e-30),
                     1.0 - torch.rand(b, 1, generator=g) * 1e-6]
            for u in draws:
                idx = inverse_cdf(probs, u)
                assert int(idx.max()) < v and int(idx.min()) >= 0
                picked = probs.gather(1, idx.unsqueeze(1)).squeeze(1)
                assert (picked > 0).all(), idx[picked == 0]
                assert _cdf_gap(probs, u, idx).max() < 1e-6


def test_inverse_cdf_u_one_picks_the_last_token_with_mass() -> None:
    v = 1000  # not a multiple of 256: the last chunk is padded with zeros
    probs = torch.zeros(4, v)
    probs[:, :10] = 0.1
    probs[0, 999] = 0.5  # the very last token
    probs[1, 767] = 0.5  # the last token of a chunk, followed by a chunk of zeros
    probs[2, 511] = 0.5
    idx = inverse_cdf(probs, torch.ones(4, 1))
    assert idx.tolist() == [999, 767, 511, 9]


def test_inverse_cdf_rows_do_not_depend_on_other_rows() -> None:
    g = torch.Generator().manual_seed(2)
    probs = _masked_probs(48, 1000, g)
    u = 1.0 - torch.rand(48, 1, generator=g)
    batch = inverse_cdf(probs, u)
    for i in range(48):
        assert torch.equal(inverse_cdf(probs[i:i + 1], u[i:i + 1]), batch[i:i + 1])
    perm = torch.randperm(48, generator=g)
    assert torch.equal(inverse_cdf(probs[perm], u[perm]), batch[perm])


# --------------------------------------------------------------------------------------------
# packed GEMMs

needs_packed = pytest.mark.skipif(not cpu_linear.packed_available(),
                                  reason="torch is built without oneDNN (mkldnn)")


def _linear(k: int, n: int, bias: bool, dtype: torch.dtype, seed: int) -> Linear:
    lin = Linear(k, n, bias=bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_is_batch_invariant(dtype, bias, tmp_path,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    # 1536 -> 576: a shape where oneDNN's unpadded single-row GEMM was measured to differ in
    # the last bits from the same row in a batch (fp32); the ROW_ALIGN padding must hide it.
    lin = _linear(1536, 576, bias, dtype, seed=int(bias))
    if dtype == torch.bfloat16 and not cpu_linear.packed_bf16_available():
        # An AVX2-only CPU (or ATEN_CPU_CAPABILITY=avx2): refused by name, not by oneDNN.
        with pytest.raises(ValueError, match="needs AVX-512"):
            cpu_linear.PackedLinear(lin)
        with pytest.raises(ValueError, match="--cpu-linear torch"):
            cpu_choice.choose_linear("packed", torch.nn.Sequential(lin), dtype)
        assert cpu_choice.choose_linear("auto", torch.nn.Sequential(lin), dtype) == "torch"
        return
    packed = cpu_linear.PackedLinear(lin)
    assert (packed.in_features, packed.out_features) == (1536, 576)
    x = torch.randn(333, 1536, generator=torch.Generator().manual_seed(9)).to(dtype)
    with torch.no_grad():
        full = packed(x)
        expected = F.linear(x, lin.weight, lin.bias)
        assert full.shape == (333, 576) and full.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-5)
        else:
            torch.testing.assert_close(full, expected)
        if not cpu_choice._rows_independent(cpu_choice._gemm_of("packed"),
                                            [(576, 1536)], dtype):
            # oneDNN computes small batches with another kernel on this CPU (bf16 on an AMX
            # Xeon): auto must see it and leave it out.
            cpu_choice.choose_linear("auto", torch.nn.Sequential(lin), dtype)
            verdict_file = tmp_path / "tuning" / "linear.json"
            verdicts = list(json.loads(verdict_file.read_text()).values())
            assert "packed" in verdicts[0]["rows_depend_on_batch"]
            return
        for m in range(1, 71):
            assert torch.equal(packed(x[:m]), full[:m]), f"first {m} rows"
            assert torch.equal(packed(x[-m:]), full[-m:]), f"last {m} rows"


_NO_BRGEMM = "torch's bf16 GEMM micro-kernel does not run on this CPU (it needs AMX)"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,n", [(1536, 576), (64, 100)])
def test_brgemm_linear_matches_f_linear_and_is_batch_invariant(k, n, bias) -> None:
    if cpu_linear.brgemm_ops() is None:
        pytest.skip(_NO_BRGEMM)
    # 64 -> 100: a last column block of 4 (the packing pads it to 32).
    lin = _linear(k, n, bias, torch.bfloat16, seed=3 + int(bias))
    gemm = cpu_linear.BrgemmLinear(lin)
    assert (gemm.in_features, gemm.out_features) == (k, n)
    x = torch.randn(333, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.no_grad():
        full = gemm(x)
        assert full.shape == (333, n) and full.dtype == torch.bfloat16
        reference = F.linear(x.float(), lin.weight.float(),
                             None if lin.bias is None else lin.bias.float())
        # One bf16 rounding of an fp32 sum: within bf16's half ulp of the exact result.
        torch.testing.assert_close(full.float(), reference, atol=1e-2, rtol=8e-3)
        for m in range(1, 71):
            assert torch.equal(gemm(x[:m]), full[:m]), f"first {m} rows"
            assert torch.equal(gemm(x[-m:]), full[-m:]), f"last {m} rows"
        assert torch.equal(gemm(x[5:6]), full[5:6])  # a single row, padded to four


def test_brgemm_choice_refused_by_name() -> None:
    lin = _linear(64, 32, False, torch.float32, seed=0)
    with pytest.raises(ValueError, match="'brgemm' runs bfloat16 weights.*--dtype bfloat16"):
        cpu_choice.choose_linear("brgemm", torch.nn.Sequential(lin), torch.float32)
    with pytest.raises(ValueError, match="'brgemm' runs bfloat16 weights"):
        cpu_linear.BrgemmLinear(lin)


def test_brgemm_left_out_for_an_odd_input_width(tmp_path, monkeypatch) -> None:
    if cpu_linear.brgemm_ops() is None:
        pytest.skip(_NO_BRGEMM)
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    odd = torch.nn.Sequential(_linear(63, 32, False, torch.bfloat16, seed=0))
    with pytest.raises(ValueError, match=r"even input widths.*\[63\]"):
        cpu_choice.choose_linear("brgemm", odd, torch.bfloat16)
    measured: list[bool] = []
    monkeypatch.setattr(cpu_choice, "_measure",
                        lambda shapes, dtype, rows=64, choices=("torch", "packed"): (
                            measured.append("brgemm" in choices) or
                            {"torch_s": 2.0, "packed_s": 1.0}))
    assert cpu_choice.choose_linear("auto", odd, torch.bfloat16) != "brgemm"
    assert measured == [False]


def test_brgemm_choice_refused_where_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linear, "brgemm_ops", lambda: None)
    lin = _linear(64, 32, False, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="needs the compiled CPU kernels.*AMX.*auto, packed"):
        cpu_choice.choose_linear("brgemm", torch.nn.Sequential(lin), torch.bfloat16)
    with pytest.raises(ValueError, match="AMX"):
        cpu_linear.BrgemmLinear(lin)


def test_pack_linears_with_brgemm(tiny_model_dir) -> None:
    if cpu_linear.brgemm_ops() is None:
        pytest.skip(_NO_BRGEMM)
    model = _load_tiny(tiny_model_dir("llama-tied"), "bfloat16")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(5, m.in_features, generator=g).to(torch.bfloat16)
              for n, m in linears.items()}
    with torch.no_grad():
        before = {n: F.linear(inputs[n].float(), m.weight.float()) for n, m in linears.items()}
    assert cpu_linear.pack_linears(model, keep_weight_of=("lm_head",), kind="brgemm") == \
        len(linears)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in linears:
            assert isinstance(modules[name], cpu_linear.BrgemmLinear), name
            torch.testing.assert_close(modules[name](inputs[name]).float(), before[name],
                                       atol=2e-2, rtol=1e-2)
    # The head keeps its plain rows (the bf16 logits refinement reads them).
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,n", [(1536, 576), (576, 49), (37, 100), (2000, 24)])
def test_tiled_linear_matches_reference_and_is_batch_invariant(ops, k, n, bias) -> None:
    # 576 -> 49 and 37 -> 100: a last panel of a few columns (zero-padded); 2000: two K
    # blocks, the partial sums stored and reloaded between them.
    lin = _linear(k, n, bias, torch.float32, seed=5 + int(bias))
    gemm = cpu_linear.TiledLinear(lin)
    assert (gemm.in_features, gemm.out_features) == (k, n)
    x = torch.randn(333, k, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = gemm(x)
        assert full.shape == (333, n) and full.dtype == torch.float32
        reference = F.linear(x.double(), lin.weight.double(),
                             None if lin.bias is None else lin.bias.double())
        torch.testing.assert_close(full.double(), reference, atol=2e-5, rtol=1e-5)
        for m in range(1, 71):
            assert torch.equal(gemm(x[:m]), full[:m]), f"first {m} rows"
        # 333 rows span three row chunks (of about 111 rows each); 1..70 rows every tail of
        # the register tile (6 rows on AVX2, 12 on AVX-512).

        def kernel(rows: torch.Tensor) -> torch.Tensor:
            return gemm.ops.tiled_linear(rows, gemm.packed, n, gemm.bias)

        assert torch.equal(kernel(x), full)
        for m in range(1, 71):
            assert torch.equal(kernel(x[:m]), full[:m]), f"first {m} rows"
            assert torch.equal(kernel(x[-m:]), full[-m:]), f"last {m} rows"
        assert torch.equal(kernel(x[5:6]), full[5:6])
        # One chunk of at most six tiles prefetches paced (36 rows on AVX2, 72 on AVX-512),
        # more tiles or chunks in a burst: same bits.
        for m in (36, 37, 72, 73, 127, 128, 129, 255, 256, 257):
            assert torch.equal(kernel(x[:m]), full[:m]), f"first {m} rows"
        wide = torch.cat([x, torch.randn(333, 3)], dim=1)[:, :k]  # rows k + 3 floats apart
        assert wide.stride(0) == k + 3
        assert torch.equal(kernel(wide), full)
        assert torch.equal(kernel(wide[:7]), full[:7])
        assert kernel(x[:0]).shape == (0, n)


def test_tiled_linear_takes_any_row_count_without_the_aligned_copy(ops, monkeypatch) -> None:
    """Its rows never read each other, so the module skips ``row_aligned`` (no padded copy);
    a module whose kernel needs the padding still goes through it."""
    lin = _linear(64, 48, True, torch.float32, seed=5)
    gemm = cpu_linear.TiledLinear(lin)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = gemm(torch.cat([x, torch.zeros(1, 64)]))[:7]

        def refuse(gemm_fn, rows):
            raise AssertionError("the module padded its rows")

        monkeypatch.setattr(cpu_linear, "row_aligned", refuse)
        for m in (1, 2, 3, 5, 7):
            assert torch.equal(gemm(x[:m]), full[:m]), m
        fused = gated.TiledGatedLinear(_linear(64, 96, False, torch.float32, seed=6))
        assert fused(x).shape == (7, 48)
        if cpu_linear.packed_available():
            with pytest.raises(AssertionError, match="padded"):
                cpu_linear.PackedLinear(lin)(x)


def test_tiled_linear_row_chunks_of_any_batch_give_the_same_rows(ops) -> None:
    """Rows are split in chunks of about equal size (whole tiles); whatever the split, a
    row's bits are its own. 2433 rows is where rounding the chunk size up to whole tiles
    needs fewer chunks than 128-row ones would."""
    lin = _linear(37, 40, True, torch.float32, seed=4)
    gemm = cpu_linear.TiledLinear(lin)
    x = torch.randn(2433, 37, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = gemm(x)
        torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias), atol=1e-5,
                                   rtol=1e-5)
        for m in (129, 136, 200, 300, 385, 1290, 2432):
            assert torch.equal(gemm(x[:m]), full[:m]), f"first {m} rows"
            assert torch.equal(gemm(x[-m:]), full[-m:]), f"last {m} rows"


def test_tiled_linear_is_independent_of_the_thread_count(ops) -> None:
    # Two K blocks and three row chunks, split over 1 and over 3 threads.
    lin = _linear(2000, 300, True, torch.float32, seed=2)
    gemm = cpu_linear.TiledLinear(lin)
    x = torch.randn(300, 2000, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    out = {}
    with torch.no_grad():
        try:
            for t in (1, 3):
                torch.set_num_threads(t)
                out[t] = gemm(x)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(out[1], out[3])


def test_tiled_kernel_refuses_mismatched_arguments(ops) -> None:
    w = torch.randn(40, 24)
    packed = ops.tiled_pack(w)
    assert packed.shape == (-(-40 // ops.tiled_panel_width()), 24, ops.tiled_panel_width())
    with pytest.raises(RuntimeError, match="K = x.size"):
        ops.tiled_linear(torch.randn(3, 25), packed, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.tiled_linear(torch.randn(3, 24), packed, 40 + ops.tiled_panel_width())
    with pytest.raises(RuntimeError, match="float32"):
        ops.tiled_linear(torch.randn(3, 24).to(torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="bias must have n elements"):
        ops.tiled_linear(torch.randn(3, 24), packed, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        ops.tiled_linear(torch.randn(3, 24, device="meta"), packed, 40)
    with pytest.raises(RuntimeError, match="bias must be on the CPU"):
        ops.tiled_linear(torch.randn(3, 24), packed, 40, torch.zeros(40, device="meta"))


def test_tiled_choice_refused_by_name(monkeypatch) -> None:
    lin = _linear(64, 32, False, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="'tiled' runs float32 weights.*--dtype float32"):
        cpu_choice.choose_linear("tiled", torch.nn.Sequential(lin), torch.bfloat16)
    with pytest.raises(ValueError, match="'tiled' runs float32 weights"):
        cpu_linear.TiledLinear(lin)
    monkeypatch.setattr(cpu_linear, "tiled_ops", lambda: None)
    lin = _linear(64, 32, False, torch.float32, seed=0)
    with pytest.raises(ValueError, match="'tiled' needs the compiled CPU kernels.*auto, packed"):
        cpu_choice.choose_linear("tiled", torch.nn.Sequential(lin), torch.float32)
    with pytest.raises(ValueError, match="CADENCE_CPU_KERNELS=0.*C\\+\\+ compiler"):
        cpu_linear.TiledLinear(lin)


def test_auto_weighs_one_row_against_64(ops, tmp_path, monkeypatch) -> None:
    """A GEMM 2 % faster at 64 rows and 1.4x slower at one row (packed oneDNN against the
    tiled kernel on an AVX2 EPYC) loses: auto times both batches and takes the least
    relative cost over them, and the cached verdict records both."""
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    rows_seen: list[int] = []
    speed = {1: {"packed": 1.4, "tiled": 1.0, "torch": 3.0},
             64: {"packed": 0.98, "tiled": 1.0, "torch": 1.5}}

    def fake_measure(shapes, dtype, rows=64, choices=()):
        rows_seen.append(rows)
        return {f"{c}_s": speed[rows][c] for c in choices}

    monkeypatch.setattr(cpu_choice, "_measure", fake_measure)
    monkeypatch.setattr(cpu_choice, "_rows_independent", lambda gemm, shapes, dtype: True)
    monkeypatch.setattr(cpu_linear, "packed_available", lambda: True)
    assert cpu_choice.choose_linear("auto", _two_linears(), torch.float32) == "tiled"
    assert sorted(rows_seen) == [1, 64]
    verdict = next(iter(json.loads((tmp_path / "tuning" / "linear.json").read_text())
                        .values()))
    assert verdict["choice"] == "tiled" and verdict["packed_s"] == 0.98
    assert verdict["relative_cost"]["tiled"] == pytest.approx((1 / 0.98) ** 0.5)
    assert verdict["relative_cost"]["packed"] == pytest.approx(1.4 ** 0.5)
    # Where one GEMM is fastest at both batches it wins outright, with cost 1.
    cost = cpu_choice._relative_cost({1: {"a_s": 1.0, "b_s": 2.0},
                                      64: {"a_s": 3.0, "b_s": 4.0}}, ["a", "b"])
    assert cost == {"a": 1.0, "b": pytest.approx((2.0 * 4 / 3) ** 0.5)}


def test_auto_measures_tiled_in_fp32_only(ops, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    seen: list[tuple[str, ...]] = []

    def fake_measure(shapes, dtype, rows=64, choices=()):
        if rows == cpu_choice._ROWS[0]:  # one entry per verdict, whatever the batches timed
            seen.append(tuple(choices))
        return {f"{c}_s": {"tiled": 1.0}.get(c, 2.0) for c in choices}

    monkeypatch.setattr(cpu_choice, "_measure", fake_measure)
    monkeypatch.setattr(cpu_choice, "_rows_independent", lambda gemm, shapes, dtype: True)
    monkeypatch.setattr(cpu_linear, "packed_available", lambda: True)  # always a rival
    assert cpu_choice.choose_linear("auto", _two_linears(), torch.float32) == "tiled"
    assert len(seen) == 1 and "tiled" in seen[0]
    if cpu_info().has_native_bf16:  # bf16 without it takes F.linear unmeasured
        assert cpu_choice.choose_linear("auto", _two_linears(), torch.bfloat16) != "tiled"
        assert len(seen) == 2 and "tiled" not in seen[1]
    # Without the compiled kernels it is not a candidate (the verdict's key says so too).
    monkeypatch.setattr(cpu_linear, "tiled_ops", lambda: None)
    before = len(seen)
    assert cpu_choice.choose_linear("auto", _two_linears(), torch.float32) != "tiled"
    assert len(seen) == before + 1 and "tiled" not in seen[-1]


def test_pack_linears_with_tiled(ops, tiny_model_dir) -> None:
    model = _load_tiny(tiny_model_dir("llama-tied"))
    embedding = model.model.embed_tokens.weight
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(5, m.in_features, generator=g) for n, m in linears.items()}
    with torch.no_grad():
        before = {n: m(inputs[n]) for n, m in linears.items()}
    assert cpu_linear.pack_linears(model, kind="tiled") == len(linears)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in linears:
            assert isinstance(modules[name], cpu_linear.TiledLinear), name
            torch.testing.assert_close(modules[name](inputs[name]), before[name], atol=1e-5,
                                       rtol=1e-5)
    assert model.model.embed_tokens.weight is embedding  # the head packed a copy


def _load_tiny(model_dir: str, dtype: str = "float32"):
    from cadence.config import ModelConfig
    from cadence.model_loader import load_model

    model, _ = load_model(ModelConfig(model_dir, dtype, 256))
    return model


@needs_packed
def test_pack_linears_replaces_every_linear_and_keeps_tied_embedding(tiny_model_dir) -> None:
    model = _load_tiny(tiny_model_dir("llama-tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    plain = embedding.detach().clone()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(5, m.in_features, generator=g) for n, m in linears.items()}
    with torch.no_grad():
        before = {n: m(inputs[n]) for n, m in linears.items()}

    assert cpu_linear.pack_linears(model) == len(linears) > 0
    assert not any(isinstance(m, Linear) for m in model.modules())
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in linears:
            assert isinstance(modules[name], cpu_linear.PackedLinear), name
            torch.testing.assert_close(modules[name](inputs[name]), before[name], atol=1e-5,
                                       rtol=1e-5)
    # The embedding still owns its plain, unchanged tensor; only the head got a packed copy.
    assert model.model.embed_tokens.weight is embedding
    assert embedding.layout == torch.strided and not embedding.is_mkldnn
    assert torch.equal(embedding, plain)
    assert model.lm_head.packed.is_mkldnn
    ids = torch.tensor([1, 5, 7])
    assert torch.equal(model.model.embed_tokens(ids), plain[ids])


# --------------------------------------------------------------------------------------------
# choose_linear


def _two_linears() -> torch.nn.Module:
    return torch.nn.Sequential(Linear(32, 64), Linear(64, 32))


def test_choose_linear_forced_and_invalid() -> None:
    model = _two_linears()
    assert cpu_choice.choose_linear("torch", model, torch.float32) == "torch"
    with pytest.raises(ValueError,
                       match=r"\('auto', 'packed', 'tiled', 'brgemm', 'amx', 'torch'\).*'fastest'"):
        cpu_choice.choose_linear("fastest", model, torch.float32)
    if cpu_linear.packed_available():
        assert cpu_choice.choose_linear("packed", model, torch.float32) == "packed"
    else:
        with pytest.raises(ValueError, match="oneDNN"):
            cpu_choice.choose_linear("packed", model, torch.float32)


@needs_packed
def test_choose_linear_auto_measures_once_and_caches(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    verdict_file = tmp_path / "tuning" / "linear.json"
    assert kernels.cache_root() == tmp_path / "kernels"
    assert cpu_choice._verdict_file() == verdict_file
    calls: list[tuple] = []

    def fake_measure(shapes, dtype, rows=64, choices=()):
        calls.append((tuple(shapes), dtype, rows))
        return {"torch_s": 2.0, "packed_s": 1.0}  # packed "wins"

    monkeypatch.setattr(cpu_choice, "_measure", fake_measure)
    # Which kernels keep rows batch-independent differs by CPU; that check has its own test.
    monkeypatch.setattr(cpu_choice, "_rows_independent", lambda gemm, shapes, dtype: True)
    model = _two_linears()
    with caplog.at_level(logging.INFO, logger="cadence.backends.cpu.linear_choice"):
        assert cpu_choice.choose_linear("auto", model, torch.float32) == "packed"
    # Timed at one row and at 64 (a decode streaming its weights, and one computing).
    assert calls == [(((32, 64), (64, 32)), torch.float32, 1),
                     (((32, 64), (64, 32)), torch.float32, 64)]
    assert any("measured GEMMs" in r.getMessage() for r in caplog.records)
    saved = json.loads(verdict_file.read_text())
    assert [v["choice"] for v in saved.values()] == ["packed"]

    # The second call (same CPU, torch, dtype, threads and shapes) reads the verdict.
    assert cpu_choice.choose_linear("auto", _two_linears(), torch.float32) == "packed"
    assert len(calls) == 2
    # A verdict of "torch" for other shapes is kept beside the first, not over it.
    monkeypatch.setattr(cpu_choice, "_measure",
                        lambda shapes, dtype, rows=64, choices=(): {"torch_s": 1.0,
                                                                    "packed_s": 3.0})
    other = torch.nn.Sequential(Linear(16, 16))
    assert cpu_choice.choose_linear("auto", other, torch.float32) == "torch"
    assert sorted(v["choice"] for v in json.loads(verdict_file.read_text()).values()) == [
        "packed", "torch"]
    assert cpu_choice.choose_linear("auto", model, torch.float32) == "packed"


@needs_packed
def test_auto_leaves_out_a_gemm_whose_rows_depend_on_the_batch(tmp_path, monkeypatch,
                                                               caplog) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_measure",
                        lambda shapes, dtype, rows=64, choices=(): {"torch_s": 2.0, "packed_s": 1.0})
    checked: list[str] = []

    def independent(gemm, shapes, dtype):
        name = "packed" if gemm is packed_gemm else "torch"
        checked.append(name)
        return name != "packed"

    packed_gemm = object()
    monkeypatch.setattr(cpu_choice, "_gemm_of", lambda c: packed_gemm if c == "packed" else c)
    monkeypatch.setattr(cpu_choice, "_rows_independent", independent)
    with caplog.at_level(logging.INFO, logger="cadence.backends.cpu.linear_choice"):
        # packed is faster, but its rows depend on the batch: F.linear it is.
        assert cpu_choice.choose_linear("auto", _two_linears(), torch.float32) == "torch"
    assert sorted(checked) == ["packed", "torch"]
    assert any("packed oneDNN left out: its rows depend on the batch" in r.getMessage()
               for r in caplog.records)
    saved = json.loads((tmp_path / "tuning" / "linear.json").read_text())
    assert [v["rows_depend_on_batch"] for v in saved.values()] == [["packed"]]

    # Every kernel batch-dependent: the fastest, with a warning that says what it costs.
    monkeypatch.setattr(cpu_choice, "_rows_independent", lambda gemm, shapes, dtype: False)
    caplog.clear()
    other = torch.nn.Sequential(Linear(16, 16))
    with caplog.at_level(logging.WARNING, logger="cadence.backends.cpu.linear_choice"):
        assert cpu_choice.choose_linear("auto", other, torch.float32) == "packed"
    assert any("async on and off may differ" in r.getMessage() for r in caplog.records)


def test_rows_independent_sees_a_batch_dependent_gemm() -> None:
    def dependent(w):  # a GEMM that adds the batch size to every output
        return lambda x: F.linear(x, w) + x.shape[0]

    assert not cpu_choice._rows_independent(dependent, [(8, 16)], torch.float32)
    assert cpu_choice._rows_independent(lambda w: (lambda x: (x[:, None, :] * w).sum(-1)),
                                        [(8, 16)], torch.float32)


@needs_packed
def test_measure_times_both_gemms() -> None:
    times = cpu_choice._measure([(64, 32), (32, 64)], torch.float32, rows=8)
    assert set(times) == {"torch_s", "packed_s"}
    assert times["torch_s"] > 0 and times["packed_s"] > 0


# --------------------------------------------------------------------------------------------
# build cache and fallbacks


def _sources() -> list[Path]:
    csrc = Path(kernels.__file__).resolve().parent / "csrc"
    return [csrc / s for s in kernels._SOURCES]


def test_build_dir_is_keyed_by_cpu_torch_and_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    sources = _sources()
    base = kernels._build_dir(sources)
    assert base.parent == tmp_path / "kernels"
    assert kernels._build_dir(sources) == base  # deterministic
    info = cpu_info()
    variants = [
        CpuInfo(info.model, info.flags ^ {"amx_tile"}),
        CpuInfo(info.model, info.flags ^ {"avx2"}),
        CpuInfo(info.model + " (other stepping)", info.flags),
    ]
    dirs = {base}
    for other in variants:
        monkeypatch.setattr(kernels, "cpu_info", lambda o=other: o)
        dirs.add(kernels._build_dir(sources))
    monkeypatch.setattr(kernels, "cpu_info", cpu_info)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    dirs.add(kernels._build_dir(sources))
    monkeypatch.undo()
    import sys
    import types

    monkeypatch.setattr(sys, "implementation",
                        types.SimpleNamespace(cache_tag="cpython-399"))  # another Python
    dirs.add(kernels._build_dir(sources))
    monkeypatch.undo()
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    # An edited source file (a copy of the tree with one byte more in one file).
    copies = tmp_path / "csrc"
    copies.mkdir()
    for src in [*sources, *(sources[0].parent / h for h in kernels._HEADERS)]:
        (copies / src.name).write_bytes(src.read_bytes())
    (copies / "ops.cpp").write_bytes((copies / "ops.cpp").read_bytes() + b"\n")
    dirs.add(kernels._build_dir([copies / s for s in kernels._SOURCES]))
    (copies / "ops.cpp").write_bytes(sources[kernels._SOURCES.index("ops.cpp")].read_bytes())
    assert kernels._build_dir([copies / s for s in kernels._SOURCES]) == base
    assert len(dirs) == 1 + len(variants) + 3, sorted(dirs)


def test_loaded_kernels_live_in_the_keyed_build_dir(ops) -> None:
    build_dir = kernels._build_dir(_sources())
    assert Path(ops.__file__).resolve().parent == build_dir.resolve()


def test_a_built_kernel_loads_without_running_the_build(ops, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda *a, **k: pytest.fail("rebuilt although the build had finished"))
    assert kernels.load_kernels() is ops


@pytest.fixture
def build_copy(ops, tmp_path) -> Path:
    """A copy of this machine's kernel build under a cache root of the test's own (ninja
    finds nothing to do there): a test may damage it while other processes use the real one."""
    import shutil

    source = kernels._build_dir(_sources())
    copy = tmp_path / "kernels" / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("lock", "cadence.lock"))
    return copy


def _load_in_child(cache_root: Path) -> str:
    """The file of the kernel module a fresh process loads from ``cache_root``; a child, as
    torch builds a second folder in one process under another module name."""
    import subprocess
    import sys

    code = ("from cadence.backends.cpu import kernels; "
            "m = kernels.load_kernels(); assert m is not None; print(m.__file__)")
    env = {**os.environ, "CADENCE_CACHE_DIR": str(cache_root)}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=False, timeout=240, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the kernel load did not finish in 240 s")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _objects(build_dir: Path) -> dict[str, int]:
    return {o.name: o.stat().st_mtime_ns for o in build_dir.glob("*.o")}


def test_a_damaged_build_record_is_built_again(build_copy) -> None:
    """The record is written again from a build that compiles nothing: the module's name is
    its folder's, so a process other than the one that built it asks ninja for the same
    commands (torch's own in-process `_v1` renaming once made this a whole rebuild)."""
    objects = _objects(build_copy)
    assert objects
    (build_copy / "built").write_text("gone\n")
    loaded = _load_in_child(build_copy.parent.parent)
    assert Path(loaded).parent == build_copy
    assert (build_copy / "built").read_text().strip() == Path(loaded).stem
    assert _objects(build_copy) == objects


def test_the_module_is_named_after_its_build_folder(tmp_path, monkeypatch) -> None:
    """Two folders built in one process keep their own names, never torch's `_v1`."""
    names: list[str] = []

    def fake_load(name, sources, build_directory, **kwargs):
        names.append(name)
        return SimpleNamespace(__name__=name)

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    for key in ("cpu_kernels_0123456789abcdef", "cpu_kernels_fedcba9876543210"):
        folder = tmp_path / key
        folder.mkdir()
        kernels._compile(_sources(), folder, locked=True)
        assert (folder / "built").read_text().strip() == names[-1]
    assert names == ["cadence_cpu_kernels_0123456789abcdef",
                     "cadence_cpu_kernels_fedcba9876543210"]


def test_a_build_killed_midway_does_not_stall_the_next_load(build_copy) -> None:
    """torch's build lock is a file; a worker killed while holding it (an engine dropped while
    its worker starts) used to leave every later load waiting on it forever."""
    (build_copy / "built").unlink()
    (build_copy / "lock").touch()  # what a build killed between taking and freeing it leaves
    loaded = _load_in_child(build_copy.parent.parent)
    assert Path(loaded).parent == build_copy
    assert (build_copy / "built").read_text().strip() == Path(loaded).stem
    assert not (build_copy / "lock").exists()


def _kernel_log(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == KERNEL_LOGGER]


def test_kernels_disabled_by_env(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CADENCE_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda *a, **k: pytest.fail("built although disabled"))
    with caplog.at_level(logging.INFO, logger=KERNEL_LOGGER):
        assert kernels.load_kernels() is None
        assert kernels.load_kernels() is None  # cached: no second message
    records = _kernel_log(caplog)
    assert len(records) == 1
    assert "CADENCE_CPU_KERNELS=0" in records[0].getMessage()
    assert "torch reference path" in records[0].getMessage()


def test_kernels_without_a_compiler_fall_back_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.delenv("CADENCE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda *a, **k: pytest.fail("built without a compiler"))
    with caplog.at_level(logging.INFO, logger=KERNEL_LOGGER):
        assert kernels.load_kernels() is None
        assert kernels.load_kernels() is None
    records = _kernel_log(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    msg = records[0].getMessage()
    assert "no C++ compiler" in msg and "torch attention path" in msg
    # The engine-level choice: 'auto' falls back, an explicit 'kernel' refuses.
    assert cpu_runtime._choose_attention("auto", 64, torch.float32) == (None, "torch")
    with pytest.raises(ValueError, match="could not be built"):
        cpu_runtime._choose_attention("kernel", 64, torch.float32)


def test_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv("CADENCE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: "/usr/bin/c++")

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'cadence_cpu_kernels'\nld: cannot find -lx")

    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    with caplog.at_level(logging.INFO, logger=KERNEL_LOGGER):
        assert kernels.load_kernels() is None
    records = _kernel_log(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "cannot find -lx" in records[0].getMessage()
    assert "torch attention path" in records[0].getMessage()


# --------------------------------------------------------------------------------------------
# whole engine


TORCH_PATH = {"overlap": "sync", "attention": "torch", "linear": "torch"}


def _greedy_run(model_dir: str, options: dict):
    # A small KV cache: the default 2 GiB costs seconds of page zeroing per engine.
    llm = make_llm(model_dir, backend_options={"kv_cache_gb": 0.02, **options},
                   max_model_len=512, dtype="float32")
    try:
        rng = random.Random(0)
        # One prompt long enough that its decodes span two of the kernel's 256-token
        # partitions, so the merge of partials is on the engine's path too.
        prompts = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]}
                   for n in (3, 40, 300, 17)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = generate(llm, prompts, params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
               for o in outs]
        backend = llm.engine.backend
        return tokens, lps, dict(backend.runtime_info), backend.runner
    finally:
        llm.engine.backend.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama-mqa"])
def test_engine_kernel_path_matches_torch_path(ops, tiny_model_dir, tmp_path, monkeypatch,
                                               kind) -> None:
    # The defaults ('auto') measure GEMMs once; keep that verdict out of the user's cache.
    monkeypatch.setattr(cpu_choice, "_verdict_file", lambda: tmp_path / "linear.json")
    model = tiny_model_dir(kind)
    tokens_t, lps_t, info_t, _ = _greedy_run(model, TORCH_PATH)
    assert info_t["cpu_attention"] == "torch" and info_t["cpu_linear"] == "torch"

    tokens_k, lps_k, info_k, runner = _greedy_run(model, {"overlap": "sync"})
    assert info_k["cpu_attention"] == "kernel"
    assert info_k["cpu_linear"] in ("packed", "tiled", "torch")
    assert isinstance(runner.attn, cpu_attention.CpuPagedAttention)
    replaced = {type(m) for m in runner.model.modules()}
    assert {KernelRMSNorm, KernelRotary} <= replaced
    # Under the tiled GEMM the activation runs inside the gate/up GEMM (gated.py).
    fused = info_k["cpu_linear"] == "tiled"
    assert (TiledGatedLinear if fused else KernelSiluAndMul) in replaced
    assert info_k["cpu_fused_mlps"] == (str(_num_layers(runner)) if fused else "0")
    assert tokens_k == tokens_t
    for a, b in zip(lps_k, lps_t):
        assert a == pytest.approx(b, abs=1e-4)

    if cpu_linear.packed_available():
        tokens_p, _, info_p, runner = _greedy_run(model, {"overlap": "sync", "linear": "packed",
                                                          "attention": "kernel"})
        assert info_p["cpu_linear"] == "packed"
        assert any(isinstance(m, cpu_linear.PackedLinear) for m in runner.model.modules())
        assert tokens_p == tokens_t
    tokens_g, lps_g, info_g, runner = _greedy_run(model, {"overlap": "sync", "linear": "tiled",
                                                          "attention": "kernel"})
    assert info_g["cpu_linear"] == "tiled"
    assert any(isinstance(m, cpu_linear.TiledLinear) for m in runner.model.modules())
    assert any(isinstance(m, TiledGatedLinear) for m in runner.model.modules())
    assert tokens_g == tokens_t
    for a, b in zip(lps_g, lps_t):
        assert a == pytest.approx(b, abs=1e-4)


def _num_layers(runner) -> int:
    return runner.model.config.num_hidden_layers


def test_engine_with_kernels_disabled_runs_the_torch_path(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_loaded", {})
    model = tiny_model_dir("llama")
    tokens, _, info, runner = _greedy_run(model, {"overlap": "sync", "linear": "torch"})
    assert info["cpu_attention"] == "torch"
    assert isinstance(runner.attn, ref.TorchPagedAttention)
    assert not any(isinstance(m, KernelRMSNorm) for m in runner.model.modules())
    assert tokens == _greedy_run(model, TORCH_PATH)[0]
    with pytest.raises(ValueError, match="could not be built"):
        make_llm(model, backend_options={"overlap": "sync", "attention": "kernel",
                                         "linear": "torch", "kv_cache_gb": 0.02})


def test_engine_refuses_kernel_attention_for_head_dim_80(tokenizer_dir, tmp_path,
                                                         monkeypatch) -> None:
    monkeypatch.setitem(model_factory.KINDS, "llama-hd80", ("llama", {"head_dim": 80}))
    model = model_factory.build_tiny_model("llama-hd80", tmp_path, tokenizer_dir)
    with pytest.raises(ValueError, match="head_dim 80"):
        make_llm(model, backend_options={"overlap": "sync", "attention": "kernel",
                                         "linear": "torch", "kv_cache_gb": 0.02})
    # 'auto' runs such a model on the torch path instead.
    _, _, info, _ = _greedy_run(model, {"overlap": "sync", "linear": "torch"})
    assert info["cpu_attention"] == "torch"


def test_malformed_kernel_input_raises_instead_of_reading_out_of_bounds():
    from cadence.backends.cpu.kernels import load_kernels

    ops = load_kernels()
    if ops is None:
        pytest.skip("the CPU kernels could not be built here (see the logged reason)")
    kc = torch.randn(4, 16, 2, 64)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_decode_attention(q, kc, kc, torch.tensor([[0, 10**8]], dtype=torch.int32),
                                   torch.tensor([20], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="num_seqs"):
        ops.paged_decode_attention(torch.randn(2, 4, 64), kc, kc,
                                   torch.tensor([[0, 1]], dtype=torch.int32),
                                   torch.tensor([20, 20], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ops.paged_decode_attention(q, kc, kc[:1], torch.tensor([[2, 3]], dtype=torch.int32),
                                   torch.tensor([20], dtype=torch.int32), 0.125)
