"""What this CPU can do, read once: model name, the vector flags the kernels and the dtype
choice depend on, and torch's own view of it. Bench JSON headers record this, because figures
from machines of one name but different CPUs are not comparable.

Reading /proc/cpuinfo needs no torch, and neither does asking for torch's view of the CPU
(``torch_facts``): where torch is not imported yet it is asked in a child interpreter, so a
benchmark's engine process stays as torch-free as a user's. That matters for what it
measures: with torch imported in the engine process, async output processing came out 1-2 %
behind sync at batch 64 in paired rounds, and level or ahead without (docs/performance.md).

torch's own ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``) caps the instruction set: set, it
makes cadence see the CPU as one without the wider vectors too (its kernels are compiled for
that level, ``--dtype auto`` decides without AVX-512 BF16), so an AVX-512 machine can run and
check the code an AVX2-only CPU (Zen 3) runs. oneDNN's GEMMs follow ``ONEDNN_MAX_CPU_ISA``
(``AVX2``), which the user sets beside it (docs/backends/cpu.md, scripts/isa_check.sh).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field

# The flags that change which kernels and dtypes are fast, in the order printed.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd",
                  "sve")


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    flags: frozenset[str] = field(default_factory=frozenset)
    family: str | None = None
    cpu_model: str | None = None
    #: The ``ATEN_CPU_CAPABILITY`` level the flags were capped to, or None.
    isa_limit: str | None = None

    @property
    def relevant_flags(self) -> list[str]:
        return [f for f in RELEVANT_FLAGS if f in self.flags]

    @property
    def has_native_bf16(self) -> bool:
        """bf16 matmuls run natively (AVX-512 BF16 or AMX), not emulated through fp32."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags, family, cpu_model = platform.processor() or platform.machine(), set(), None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "cpu family" and family is None:
                    family = value
                elif key == "model" and cpu_model is None:
                    cpu_model = value
                if key == "" and flags and model:
                    break
    except OSError:
        pass
    limit = isa_limit()
    if limit is not None:
        flags = {f for f in flags if not f.startswith(_ABOVE[limit])}
    return CpuInfo(model, frozenset(flags), family, cpu_model, limit)


# Per capped level, the flag prefixes it hides. "default" is torch's scalar-plus-SSE build.
_ABOVE = {"avx2": ("avx512", "amx"), "default": ("avx", "fma", "f16c", "amx")}


def isa_limit() -> str | None:
    """torch's ``ATEN_CPU_CAPABILITY`` when it lowers the instruction set (``avx2`` or
    ``default``); None when unset or ``avx512`` (which hides nothing cadence picks by)."""
    value = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return value if value in _ABOVE else None


def _facts_here() -> dict[str, object]:
    import torch

    try:
        cap = str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # torch < 2.1
        cap = "unknown"
    return {"version": torch.__version__, "capability": cap,
            "num_threads": torch.get_num_threads()}


# The child asks the same function; importing cadence.cpuinfo loads no torch of its own.
_PROBE = ("import json\nfrom cadence.cpuinfo import _facts_here\n"
          "print(json.dumps(_facts_here()))")


def torch_facts() -> dict[str, object]:
    """torch's version, its CPU capability and its default thread count, as a fresh process
    (an engine's worker) sees them under this environment. Taken from torch itself when this
    process has already imported it, else from a child interpreter (about a second, once),
    so that asking does not load torch and its OpenMP runtime here. Where the child fails,
    the facts are "unknown" / None and a warning says why: a benchmark still runs."""
    return dict(_torch_facts())


@functools.cache
def _torch_facts() -> dict[str, object]:
    import sys

    if "torch" in sys.modules:
        return _facts_here()
    import json
    import subprocess

    # -P: a module of the current directory named like torch or json must not shadow it.
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    try:
        done = subprocess.run([sys.executable, *safe, "-c", _PROBE], capture_output=True,
                              text=True, timeout=120, check=True)
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        import logging

        detail = getattr(e, "stderr", None) or e
        logging.getLogger(__name__).warning(
            "could not ask a child interpreter for torch's version, CPU capability and "
            "thread count; they are recorded as unknown: %s", str(detail).strip()[-500:])
        return {"version": "unknown", "capability": "unknown", "num_threads": None}


def torch_capability() -> str:
    return str(torch_facts()["capability"])


def describe(num_threads: int | None = None, dtype: str | None = None) -> dict[str, object]:
    """The machine block every bench JSON and performance table carries."""
    from cadence.host_memory import thp_mode

    info = cpu_info()
    out: dict[str, object] = {
        "cpu_model": info.model,
        "cpu_family": info.family,
        "cpu_model_id": info.cpu_model,
        "cpu_flags": info.relevant_flags,
        "torch_cpu_capability": torch_capability(),
        "native_bf16": info.has_native_bf16,
        "cpu_count": os.cpu_count(),
        # Streamed weights and KV cache run faster on huge pages (docs/backends/cpu.md).
        "transparent_hugepages": thp_mode(),
    }
    if info.isa_limit is not None:
        out["isa_limit"] = info.isa_limit
        out["onednn_max_cpu_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if num_threads is not None:
        out["threads"] = num_threads
    if dtype is not None:
        out["dtype"] = dtype
    return out
