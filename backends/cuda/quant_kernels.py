"""The CUDA backend's GEMM on compressed weights: y = x @ w.T (+ bias) with
w = scale * q (+ offset) per group of consecutive inputs, the form every quantization
method of cadence/quantization loads into (``QuantizedWeight``: int8, GGUF blocks, AWQ,
GPTQ, compressed-tensors).

Storage (``pack``), chosen per weight from its values:

- **4 bits** when a weight's values span at most 16 consecutive integers (AWQ's and GPTQ's
  0..15 at 4 bits, Q4 blocks' -8..7): two values a byte, ``q - qmin`` in a nibble, a
  quarter of the fp16 weight's bytes. Within each run of 32 inputs, byte ``i`` holds input
  ``i`` in its low nibble and input ``i + 16`` in its high one, so a tile's two nibble
  planes are two contiguous halves of each 32-input run and each feeds its own ``tl.dot``
  (no interleave in registers).
- **8 bits** otherwise (int8, GPTQ at 8 bits, Q8_0, Q5/Q6 blocks): the int8 values as
  they are, half the fp16 weight's bytes.

Scales and offsets stay fp32, one per group; the kernel takes a group per K step
(``BLOCK_K`` divides the group), loads its [BLOCK_N] scales once, dequantizes in fp32
(``s * q + o``: for AWQ and GPTQ every product and sum is exact in fp32, see
cadence/quantization/packed.py), rounds the tile to the activations' dtype and multiplies
on the tensor cores with fp32 accumulation; fp32 activations multiply in full fp32
(``input_precision="ieee"``, not TF32). So a bf16 or fp16 model computes what it would on
the dequantized weights rounded to its dtype, up to the order of the sums.

Imported only when a CUDA backend runs quantized weights; ``TRITON_INTERPRET=1`` runs it on
CPU tensors as for the other kernels (``triton_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Inputs per nibble run: byte i of a run holds inputs i and i + RUN // 2.
RUN = 32


@dataclass
class PackedWeight:
    """A ``QuantizedWeight`` in the kernel's storage (module docstring)."""

    data: torch.Tensor  # uint8 [N, K / 2] (4 bits) or int8 [N, K] (8 bits)
    scale: torch.Tensor  # fp32 [N, K / group]
    offset: torch.Tensor | None  # fp32 like scale, or None
    bits: int
    qmin: int  # 4 bits: the value a zero nibble stands for
    group: int
    in_features: int

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.data.to(device), self.scale.to(device),
                            None if self.offset is None else self.offset.to(device),
                            self.bits, self.qmin, self.group, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset)
                   if t is not None)


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> PackedWeight:
    """``QuantizedWeight``'s parts (q int8 [N, K], fp32 scale and offset [N, K / group]) in
    the kernel's storage: 4 bits where the values allow it (module docstring), else 8."""
    n, k = q.shape
    group = k // scale.shape[1]
    lo, hi = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
    scale = scale.float().contiguous()
    offset = None if offset is None else offset.float().contiguous()
    if hi - lo < 16 and k % RUN == 0 and group % RUN == 0:
        runs = (q.to(torch.int16) - lo).to(torch.uint8).view(n, k // RUN, 2, RUN // 2)
        data = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)
        return PackedWeight(data.contiguous(), scale, offset, 4, lo, group, k)
    return PackedWeight(q.to(torch.int8).contiguous(), scale, offset, 8, 0, group, k)


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The int8 values ``pack`` stored, [N, K] (the inverse of its layout)."""
    return _unpack(weight, weight.data)


def unpack_rows(weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
    """The int8 values of rows ``index`` only, [len(index), K]: no host sync, so a
    captured graph may run it."""
    return _unpack(weight, weight.data.index_select(0, index))


def _unpack(weight: PackedWeight, data: torch.Tensor) -> torch.Tensor:
    if weight.bits == 8:
        return data
    n = data.shape[0]
    runs = data.view(n, -1, 1, RUN // 2).to(torch.int16)
    both = torch.cat([runs & 15, runs >> 4], dim=2)
    return (both + weight.qmin).to(torch.int8).reshape(n, weight.in_features)


@triton.jit
def _dequant_dot(acc, rows_x, kk, m_ok, q, s, o, HAS_OFFSET: tl.constexpr,
                 IEEE: tl.constexpr):
    # acc + x[:, kk] @ w, w = s * q (+ o) expanded in fp32 for the tile's inputs kk, then
    # multiplied in the activations' dtype (in full fp32 under IEEE).
    w = q.to(tl.float32) * s[None, :]
    if HAS_OFFSET:
        w = w + o[None, :]
    a = tl.load(rows_x + kk[None, :], mask=m_ok[:, None], other=0.0)
    if IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


# M (the step's token count) changes every step: not specialized (see triton_kernels.py).
@triton.jit(do_not_specialize=["M"])
def _quant_linear_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K, group,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, QMIN: tl.constexpr, HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_x = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    cols_w = offs_n[None, :].to(tl.int64) * stride_wn
    scales = s_ptr + offs_n.to(tl.int64) * stride_sn
    offsets = o_ptr + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 4:
        # Half a tile's inputs per nibble plane: the low nibbles are inputs
        # run * RUN + i, the high ones run * RUN + 16 + i (i < 16).
        half = tl.arange(0, BLOCK_K // 2)
        low_k = (half // 16) * 32 + half % 16
    else:
        offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // group
        s = tl.load(scales + g, mask=n_ok, other=0.0)
        o = tl.load(offsets + g, mask=n_ok, other=0.0) if HAS_OFFSET else s
        if BITS == 4:
            byte = tl.load(w_ptr + cols_w + (k0 // 2 + half)[:, None], mask=n_ok[None, :],
                           other=0)
            acc = _dequant_dot(acc, rows_x, k0 + low_k, m_ok,
                               (byte & 15).to(tl.int32) + QMIN, s, o, HAS_OFFSET, IEEE)
            acc = _dequant_dot(acc, rows_x, k0 + low_k + 16, m_ok,
                               (byte >> 4).to(tl.int32) + QMIN, s, o, HAS_OFFSET, IEEE)
        else:
            kk = k0 + offs_k
            q = tl.load(w_ptr + cols_w + kk[:, None], mask=n_ok[None, :], other=0)
            acc = _dequant_dot(acc, rows_x, kk, m_ok, q, s, o, HAS_OFFSET, IEEE)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_sizes(num_rows: int, weight: PackedWeight) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): ``tl.dot`` needs 16 at least on each side; BLOCK_K
    divides the group (one scale per column and step) and, at 4 bits, covers whole runs
    with 16 inputs per nibble plane at least."""
    bm = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    bk = 64
    while weight.group % bk:
        bk //= 2
    if bk < (RUN if weight.bits == 4 else 16):
        raise ValueError(f"a group of {weight.group} inputs is too small for this kernel")
    return bm, 64, bk


def check_group(group: int) -> bool:
    """Whether the kernel runs weights with ``group`` inputs per scale (a multiple of 16)."""
    return group % 16 == 0


def quant_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [M, K] -> x @ w.T (+ bias) [M, N] in x's dtype, w dequantized from ``weight``."""
    m, k = x.shape
    n = weight.data.shape[0]
    assert k == weight.in_features, (x.shape, weight.in_features)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = block_sizes(m, weight)
    has_offset = weight.offset is not None
    _quant_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, weight.data, weight.scale, weight.offset if has_offset else weight.scale,
        bias if bias is not None else weight.scale, y, m, n, k, weight.group,
        x.stride(0), weight.data.stride(0), weight.scale.stride(0), y.stride(0),
        BITS=weight.bits, QMIN=weight.qmin, HAS_OFFSET=has_offset,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
