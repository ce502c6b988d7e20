"""Optional fused CPU kernels, built as a torch C++ extension on first use.

``load_paged_decode()`` compiles ``cpu_paged_decode.cpp`` (next to this file) with
``torch.utils.cpp_extension.load`` the first time it is called (tens of seconds; torch caches
the build under ``TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``, so later processes
only load it) and returns ``paged_decode`` — or ``None`` when the kernel is disabled
(``CADENCE_CPU_KERNELS=0``) or cannot be built (no compiler, no ninja, a build error, ...).
On failure one warning with the reason is logged and the caller keeps its torch (SDPA) path.
The result, success or failure, is cached for the process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
_EXT_NAME = "cadence_cpu_paged_decode"
# -ffp-contract=off and no -ffast-math: vectorized, but the float operations keep the source
# order, so results are deterministic and match across batch compositions.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math"]

_lock = threading.Lock()
_loaded = False
_kernel: Callable[..., torch.Tensor] | None = None
compile_seconds: float | None = None  # time the first load took (build or cache hit)
failure_reason: str | None = None


def kernels_enabled() -> bool:
    return os.environ.get("CADENCE_CPU_KERNELS", "1").strip().lower() not in (
        "0", "false", "no", "off")


def _build() -> Callable[..., torch.Tensor]:
    from torch.utils import cpp_extension

    if not _SOURCE.is_file():
        raise FileNotFoundError(f"kernel source {_SOURCE} is missing")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not available (pip install ninja)")
    mod = cpp_extension.load(name=_EXT_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                             verbose=False)
    return mod.paged_decode


def load_paged_decode() -> Callable[..., torch.Tensor] | None:
    """The fused decode kernel ``paged_decode(q, k_cache, v_cache, tables, seq_lens,
    block_size, scale) -> [B, H, D]``, or None (disabled / build failed; warned once)."""
    global _loaded, _kernel, compile_seconds, failure_reason
    if _loaded:
        return _kernel
    with _lock:
        if _loaded:
            return _kernel
        if not kernels_enabled():
            failure_reason = "disabled by CADENCE_CPU_KERNELS=0"
            logger.info("fused CPU paged-decode kernel %s", failure_reason)
        else:
            t0 = time.perf_counter()
            try:
                raw = _build()
            except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
                failure_reason = f"{type(e).__name__}: {str(e).strip()[:500]}"
                logger.warning("fused CPU paged-decode kernel unavailable, using the SDPA "
                               "path: %s", failure_reason)
            else:
                compile_seconds = time.perf_counter() - t0
                logger.info("fused CPU paged-decode kernel ready in %.1f s", compile_seconds)
                _kernel = _wrap(raw)
        _loaded = True
        return _kernel


def _wrap(raw: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     scale: float) -> torch.Tensor:
        """q [B, H, D] fp32; caches [num_blocks * block_size, KVH, D] fp32; tables [B, NB]
        int64 block ids; seq_lens [B] int64 (row b attends to its first seq_lens[b] tokens)
        -> [B, H, D]."""
        if seq_lens.dtype != torch.int64:
            seq_lens = seq_lens.to(torch.int64)
        if tables.dtype != torch.int64:
            tables = tables.to(torch.int64)
        return raw(q, k_cache, v_cache, tables, seq_lens, int(block_size), float(scale))

    return paged_decode


def _reset_for_tests() -> None:
    global _loaded, _kernel, compile_seconds, failure_reason
    with _lock:
        _loaded, _kernel, compile_seconds, failure_reason = False, None, None, None
