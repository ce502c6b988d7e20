"""GEMMs on weights packed once at load time (oneDNN), chosen per CPU by measurement.

``torch.ops.mkldnn._reorder_linear_weight`` reorders a weight into oneDNN's blocked layout
for this CPU, and ``_linear_pointwise`` runs the GEMM on it: what inductor's weight
prepacking and vLLM's CPU path do. Measured on an AVX-512 EPYC at 64 rows it ran the
SmolLM2 layer GEMMs ~1.5x faster than ``F.linear`` in fp32 and ~1.3x in bf16, and the LM head
2.2x (docs/backends/cpu.md). Whether it wins elsewhere is measured, not assumed:
``choose_linear`` times both on the model's own shapes once per CPU/torch/dtype and caches
the verdict, so later runs on the machine make the same choice.

NOTE batch invariance: oneDNN computes a single row with another kernel (measured: M=1
differs in the last bits from the same row in any larger batch; every M >= 2 agrees). Rows
go through ``cadence.layers.linear.row_aligned`` like ``F.linear``'s, so no
GEMM ever runs with one row and a request's logits never depend on its batch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from cadence.cpuinfo import cpu_info
from cadence.distributed import all_reduce
from cadence.layers.linear import Linear, row_aligned

logger = logging.getLogger(__name__)

LINEAR_CHOICES = ("auto", "packed", "torch")


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


# oneDNN's bf16 weight reorder refuses a CPU without these (torch's own check): an AVX2-only
# CPU such as Zen 3 has neither, and would fail at load with a message about oneDNN.
_PACKED_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def packed_bf16_available() -> bool:
    flags = cpu_info().flags
    return any(need <= flags for need in _PACKED_BF16_FLAGS)


_NO_PACKED_BF16 = ("cpu linear 'packed' in bfloat16 needs AVX-512 (avx512bw, avx512vl, "
                   "avx512dq) or AVX-NE-CONVERT, which this CPU lacks; use --cpu-linear torch "
                   "or auto, or --dtype float32")


class PackedLinear(nn.Module):
    """A ``Linear`` whose weight lives in oneDNN's packed layout; same maths, same rows."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        if w.dtype == torch.bfloat16 and not packed_bf16_available():
            raise ValueError(_NO_PACKED_BF16)
        self.weight_dtype = w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # A row-parallel layer's partial outputs are summed over the tensor-parallel ranks.
        self.reduce_output = bool(getattr(linear, "reduce_output", False))
        if keep_weight:
            # The plain rows stay readable for whoever recomputes a few outputs exactly (the
            # LM head's tied maxima, core/layers/logits.py); free when tied to the embeddings.
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_aligned(self._gemm, x)
        return all_reduce(out) if self.reduce_output else out

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, keep_weight_of: tuple[str, ...] = ()) -> int:
    """Replace every ``cadence.layers.linear.Linear`` in ``model`` by a ``PackedLinear``.

    A weight shared with another module (the LM head tied to the embeddings) is packed as a
    copy; the other module keeps the plain tensor. Modules named in ``keep_weight_of`` keep
    their plain weight too (an untied one then costs its size twice).
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, PackedLinear(child, keep_weight=name in keep_weight_of))
                count += 1
    return count


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _measure(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: int = 64) -> dict:
    """Seconds per pass over ``shapes`` for F.linear and for the packed GEMM (best of 5)."""
    g = torch.Generator().manual_seed(0)
    plain = packed = 0.0
    for n, k in shapes:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        wp = torch.ops.mkldnn._reorder_linear_weight(w)
        plain += _time(lambda x=x, w=w: torch.nn.functional.linear(x, w), 5)
        packed += _time(lambda x=x, wp=wp: torch.ops.mkldnn._linear_pointwise(
            x, wp, None, "none", [], ""), 5)
    return {"torch_s": plain, "packed_s": packed}


def _verdict_file() -> Path:
    from cadence.cache_dir import cache_dir

    return cache_dir("tuning", "linear.json")


def choose_linear(requested: str, model: nn.Module, dtype: torch.dtype) -> str:
    """``packed`` or ``torch`` for ``requested`` in LINEAR_CHOICES (auto measures, once)."""
    if requested not in LINEAR_CHOICES:
        raise ValueError(f"cpu linear must be one of {LINEAR_CHOICES}, got {requested!r}")
    if requested == "torch":
        return "torch"
    if not packed_available():
        if requested == "packed":
            raise ValueError("cpu linear 'packed' needs torch built with oneDNN (mkldnn)")
        return "torch"
    if requested == "packed":
        if dtype == torch.bfloat16 and not packed_bf16_available():
            raise ValueError(_NO_PACKED_BF16)
        return "packed"
    if dtype == torch.bfloat16 and not cpu_info().has_native_bf16:
        return "torch"  # oneDNN has no fast bf16 path without AVX-512 BF16/AMX
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)})
    info = cpu_info()
    key = json.dumps([info.model, info.relevant_flags, torch.__version__, str(dtype),
                      torch.get_num_threads(), shapes])
    path = _verdict_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One process measures; others wait on the lock and read its verdict, so two engines
    # started together on one machine never run different GEMMs.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            verdicts = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            verdicts = {}  # unreadable or half-written by a killed process: measure again
        if key not in verdicts:
            times = _measure([s for s in shapes if s[0] <= 8192], dtype)
            choice = "packed" if times["packed_s"] <= times["torch_s"] else "torch"
            verdicts[key] = {"choice": choice, **times}
            path.write_text(json.dumps(verdicts, indent=1))
            logger.info("measured GEMMs on this CPU (%s): F.linear %.2f ms, packed oneDNN "
                        "%.2f ms per layer -> %s (cached in %s)", str(dtype),
                        times["torch_s"] * 1e3, times["packed_s"] * 1e3, choice, path)
    return verdicts[key]["choice"]
