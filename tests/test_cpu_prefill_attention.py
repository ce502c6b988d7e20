"""The CPU backend's prefill attention kernel (csrc/prefill_attention.cpp) against SDPA, one
prompt at a time: fp32 to rounding, bf16 to a bf16 step, every prompt of a step in one call
with the other rows of the batch left alone, and each prompt's bits independent of the
batch and of the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _batch(lens: list[int], h: int, kvh: int, d: int, dtype: torch.dtype, seed: int,
           lead: int = 3):
    """q, k, v as strided views of one fused qkv output of ``lead`` decode rows followed by
    the prompts; returns them with the prompts' starts and lengths."""
    t = lead + sum(lens)
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    starts, s = [], lead
    for n in lens:
        starts.append(s)
        s += n
    return (q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d),
            torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64))


def _sdpa(q, k, v, start: int, n: int, scale: float) -> torch.Tensor:
    qt, kt, vt = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


CASES = [  # (head_dim, heads, kv heads, prompt lengths)
    (64, 9, 3, [1, 15, 16, 17, 100]),  # SmolLM2's shape; tile edges
    (64, 8, 8, [33, 2]),  # no GQA
    (16, 4, 2, [5, 70]),
    (32, 8, 2, [130]),  # several query tiles of one prompt
    (128, 4, 1, [40, 9]),
    (256, 2, 2, [20]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-kv{c[2]}")
def test_prefill_attention_matches_sdpa_fp32(ops, case) -> None:
    d, h, kvh, lens = case
    q, k, v, starts, ln = _batch(lens, h, kvh, d, torch.float32, seed=d + h)
    out = torch.full_like(q, 7.0)
    ops.prefill_attention(q, k, v, out, starts, ln, d ** -0.5)
    for s, n in zip(starts.tolist(), lens):
        torch.testing.assert_close(out[s:s + n], _sdpa(q, k, v, s, n, d ** -0.5),
                                   atol=3e-5, rtol=1e-4)
    assert bool((out[:3] == 7.0).all()), "rows outside the prompts were written"


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"d{c[0]}-h{c[1]}-kv{c[2]}")
def test_prefill_attention_bf16_within_a_step_of_fp32(ops, case) -> None:
    d, h, kvh, lens = case
    q, k, v, starts, ln = _batch(lens, h, kvh, d, torch.bfloat16, seed=d)
    out = torch.empty_like(q)
    ops.prefill_attention(q, k, v, out, starts, ln, d ** -0.5)
    qf, kf, vf = q.float(), k.float(), v.float()
    for s, n in zip(starts.tolist(), lens):
        exact = _sdpa(qf, kf, vf, s, n, d ** -0.5)
        # fp32 accumulation, one rounding at the end: within one bf16 step of the exact value
        step = exact.abs().clamp(min=2.0 ** -10) * 2.0 ** -7
        assert bool(((out[s:s + n].float() - exact).abs() <= step).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_is_batch_and_thread_invariant(ops, restore_threads, dtype) -> None:
    d, h, kvh = 64, 9, 3
    lens = [37, 1, 200, 64]
    q, k, v, starts, ln = _batch(lens, h, kvh, d, dtype, seed=1)
    torch.set_num_threads(2)
    batch = torch.zeros_like(q)
    ops.prefill_attention(q, k, v, batch, starts, ln, 0.125)
    torch.set_num_threads(1)
    one_thread = torch.zeros_like(q)
    ops.prefill_attention(q, k, v, one_thread, starts, ln, 0.125)
    assert torch.equal(one_thread, batch)
    torch.set_num_threads(2)
    for i, (s, n) in enumerate(zip(starts.tolist(), lens)):
        alone = torch.zeros_like(q)
        ops.prefill_attention(q, k, v, alone, starts[i:i + 1], ln[i:i + 1], 0.125)
        assert torch.equal(alone[s:s + n], batch[s:s + n]), f"prompt {i}: alone != batch"


def test_prefill_attention_rejects_bad_input(ops) -> None:
    q, k, v, starts, ln = _batch([4, 4], 4, 2, 16, torch.float32, seed=0)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="runs past the token batch"):
        ops.prefill_attention(q, k, v, out, starts, ln + 10, 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.prefill_attention(q, k.bfloat16(), v, out, starts, ln, 0.25)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.prefill_attention(q, k, v, out.transpose(0, 1), starts, ln, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        ops.prefill_attention(q, k, v, out, starts.int(), ln, 0.25)
    with pytest.raises(RuntimeError, match="head_dim must be one of"):
        q2, k2, v2, s2, l2 = _batch([3], 2, 2, 24, torch.float32, seed=0)
        ops.prefill_attention(q2, k2, v2, torch.empty_like(q2), s2, l2, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,h,kvh", [(64, 9, 3), (32, 4, 4), (128, 4, 2)])
def test_prefill_rows_have_the_decode_kernels_bits(ops, dtype, d, h, kvh) -> None:
    """Every prompt row equals the decode kernel's output for that token over the same
    cache: a recompute after preemption (decoded tokens become prompt rows) changes nothing,
    which async on == off relies on. Lengths cross the 256-key partitions."""
    lens = [300, 7, 530]
    q, k, v, starts, ln = _batch(lens, h, kvh, d, dtype, seed=3)
    out = torch.zeros_like(q)
    ops.prefill_attention(q, k, v, out, starts, ln, d ** -0.5)
    bs = 16
    for s, n in zip(starts.tolist(), lens):
        nb = -(-n // bs)
        table = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(n))[:nb]
        kc = torch.zeros((nb + 3) * bs, kvh, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        slots = (table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb))[:n]
        kc[slots], vc[slots] = k[s:s + n], v[s:s + n]
        tables = table.int().expand(n, nb).contiguous()
        decode = ops.paged_decode_attention(
            q[s:s + n], kc.view(-1, bs, kvh, d), vc.view(-1, bs, kvh, d), tables,
            torch.arange(1, n + 1, dtype=torch.int32), d ** -0.5)
        assert torch.equal(out[s:s + n], decode), (
            f"prompt of {n}: {(out[s:s + n] != decode).sum().item()} values differ")
