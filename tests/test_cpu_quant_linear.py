"""The CPU GEMM on compressed weights (csrc/quant_linear.cpp): for any int8 values, group
scales and offsets, its outputs are the fp32 tiled GEMM's on the dequantized weight, bit for
bit, at every row count (the direct path of up to 4 rows and the buffered one), with and
without offsets, groups of 16 and 32, a short last panel, and the gated MLP's fused layout."""

from __future__ import annotations

import pytest
import torch

from cadence.quantization.weights import QuantizedWeight


def _weight(n: int, k: int, group: int, offset: bool, seed: int, lo: int = -128,
            hi: int = 128) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    off = (torch.rand(n, k // group, generator=g) - 0.5) * 0.1 if offset else None
    return QuantizedWeight(q, scale, off)


# Value ranges: int8's whole range (a byte a value), and ranges of 16 values (the 4-bit
# formats', two values a byte): signed, unsigned, and one without 0 (the padding's value).
@pytest.mark.parametrize("n,k,group,offset,lo,hi", [
    (96, 64, 32, True, -128, 128), (100, 96, 16, False, -128, 128),
    (40, 576, 32, True, 0, 16), (33, 1536, 32, False, -8, 8), (50, 320, 32, True, 3, 19),
    (20, 40, 40, False, -127, 128)])  # one group a row (int8 where K is not a multiple of 32)
def test_same_bits_as_the_fp32_tiled_gemm_at_every_row_count(ops, n, k, group, offset, lo, hi):
    w = _weight(n, k, group, offset, seed=n + k, lo=lo, hi=hi)
    dense = ops.tiled_pack(w.dequantize())
    packed = ops.qtiled_pack(w.q, w.scale, w.offset)
    bits = 8 if hi - lo > 16 else 4
    assert packed[0].shape[2] * 8 // bits == ops.tiled_panel_width()
    bias = torch.randn(n)
    x = torch.randn(200, k)
    full = ops.qtiled_linear(x, packed, n, bias)
    assert torch.equal(full, ops.tiled_linear(x, dense, n, bias))
    for m in (1, 2, 3, 4, 5, 7, 13, 64, 130):
        got = ops.qtiled_linear(x[:m], packed, n, bias)
        # The fp32 kernel's bits, and each row's bits whatever the batch.
        assert torch.equal(got, ops.tiled_linear(x[:m], dense, n, bias)), m
        assert torch.equal(got, full[:m]), m


def test_a_strided_row_view_reads_the_same_rows(ops):
    w = _weight(64, 64, 32, True, seed=3)
    packed = ops.qtiled_pack(w.q, w.scale, w.offset)
    x = torch.randn(6, 128)[:, :64]
    assert torch.equal(ops.qtiled_linear(x, packed, 64, None),
                       ops.qtiled_linear(x.contiguous(), packed, 64, None))


def test_gated_layout_gives_the_fused_fp32_bits(ops):
    half = 4 * ops.tiled_panel_width()
    w = _weight(2 * half, 64, 32, True, seed=5, lo=0, hi=16)
    dense = ops.tiled_pack_gated(w.dequantize())
    packed = ops.qtiled_pack_gated(w.q, w.scale, w.offset)
    x = torch.randn(70, 64)
    for m in (1, 3, 70):
        assert torch.equal(ops.qtiled_linear_gated(x[:m], packed, half, None),
                           ops.tiled_linear_gated(x[:m], dense, half, None))


def test_bad_parts_are_refused(ops):
    w = _weight(32, 64, 32, True, seed=7)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.qtiled_pack(w.q.float(), w.scale, None)
    with pytest.raises(RuntimeError, match="group dividing K"):
        ops.qtiled_pack(w.q, torch.rand(32, 3), None)
    with pytest.raises(RuntimeError, match="shaped as s"):
        ops.qtiled_pack(w.q, w.scale, torch.rand(32, 1))
    packed = ops.qtiled_pack(w.q, w.scale, w.offset)
    with pytest.raises(RuntimeError, match="K = x.size"):
        ops.qtiled_linear(torch.randn(2, 32), packed, 32, None)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.qtiled_linear(torch.randn(2, 64), packed, 1000, None)
