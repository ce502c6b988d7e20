"""llama.cpp's block formats, unpacked into what the CPU kernel reads: an integer per weight and
an fp32 scale (and offset) per group of consecutive inputs.

Every format handled here dequantizes to ``w = s * q`` or ``w = s * q + o`` per group, with
``s`` and ``o`` fp32 values computed from the block's fp16 fields (K-quants: the super-block's
fp16 scale times a sub-block's 6- or 8-bit scale) and each operation rounded to fp32: that is
how gguf-py's ``dequantize`` computes it, and transformers dequantizes GGUF files with it. So
the unpacked parts, multiplied (and added) the same way, give exactly the fp32 weights of the
converted model folder; ``unpack`` is checked against ``gguf.quants.dequantize`` bit for bit
(tests/test_quantization.py), and every tensor is checked against the folder's weights once
more when the blocks are exported (``gguf_export``).

Formats with other arithmetic (Q2_K, Q3_K, the IQ types) are not unpacked: their tensors stay
in the folder's fp32 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Unpacked:
    """One tensor's blocks: q [rows, K] int8, scale [rows, K / group] fp32, offset as scale
    or None (then ``w = scale * q``)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> np.ndarray:
        s = np.repeat(self.scale, self.group, axis=1)
        w = s * self.q.astype(np.float32)
        if self.offset is not None:
            w = w + np.repeat(self.offset, self.group, axis=1)
        return w


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes holding two 4-bit values -> the values, low nibbles of each run of ``width`` bytes
    first, then their high nibbles (llama.cpp's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a uint32 per block) -> [blocks, 32] of 0/1."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q8_0(b):
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None


def _q4_0(b):
    return (_nibbles(b[:, 2:], 16).astype(np.int8) - np.int8(8)), _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16) | (_fifth_bits(b[:, 2:6]) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | (_fifth_bits(b[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _k_groups(b: np.ndarray):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    # gguf-py: d * sc and dmin * m, each one fp32 product; w = (d * sc) * q - (dmin * m).
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(b):
    scale, offset = _k_groups(b)
    q = _nibbles(b[:, 16:], 32).astype(np.int8)
    return q, scale, offset


def _q5_k(b):
    scale, offset = _k_groups(b)
    n = b.shape[0]
    ql = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (ql | ((qh & np.uint8(1)) << np.uint8(4))).reshape(n, 256)
    return q.astype(np.int8), scale, offset


def _q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(n, -1, 32)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q.reshape(n, 256), scale, None


# name -> (elements per block, bytes per block, elements per group, unpack)
FORMATS = {
    "Q8_0": (32, 34, 32, _q8_0),
    "Q4_0": (32, 18, 32, _q4_0),
    "Q4_1": (32, 20, 32, _q4_1),
    "Q5_0": (32, 22, 32, _q5_0),
    "Q5_1": (32, 24, 32, _q5_1),
    "Q4_K": (256, 144, 32, _q4_k),
    "Q5_K": (256, 176, 32, _q5_k),
    "Q6_K": (256, 210, 16, _q6_k),
}


def unpack(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> Unpacked:
    """The bytes of an [rows, K] tensor stored in block format ``fmt`` -> its parts."""
    per_block, nbytes, group, fn = FORMATS[fmt]
    rows, k = shape
    if k % per_block:
        raise ValueError(f"{fmt} rows of {k} values are not whole blocks of {per_block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    q, scale, offset = fn(blocks)
    scale = np.asarray(scale, dtype=np.float32).reshape(rows, k // group)
    if offset is not None:
        offset = np.asarray(offset, dtype=np.float32).reshape(rows, k // group)
    return Unpacked(np.ascontiguousarray(q.reshape(rows, k)), np.ascontiguousarray(scale),
                    offset if offset is None else np.ascontiguousarray(offset))
