"""``--dtype auto`` on the CPU: bfloat16 where the CPU computes it natively and the model was
trained in it, float32 otherwise.

Measured on an AVX-512 BF16 EPYC (docs/performance.md): the default model runs ~1.4x faster
in bf16 than in fp32 (oneDNN's bf16 GEMMs do twice the work per cycle and the weights and KV
cache move half the bytes). Without AVX-512 BF16 or AMX, bf16 is emulated through fp32 and
~7x slower, so fp32 is the only sensible choice there. A model released in fp32 or fp16
stays in fp32: casting it to bf16 would change its outputs for speed the user did not ask
for. The choice is printed once at start-up.
"""

from __future__ import annotations

import sys

from cadence.cpuinfo import cpu_info
from cadence.engine_args import trained_dtype


def resolve_auto_dtype(model: str, announce: bool = True) -> str:
    info = cpu_info()
    trained = trained_dtype(model)
    if info.has_native_bf16 and trained == "bfloat16":
        dtype, why = "bfloat16", "the CPU has native bf16 and the model was trained in bf16"
    elif not info.has_native_bf16:
        dtype, why = "float32", "the CPU has no native bf16 (AVX-512 BF16 or AMX)"
    else:
        dtype, why = "float32", f"the model's checkpoint is {trained or 'of unknown dtype'}"
    if announce:
        print(f"cadence: --dtype auto -> {dtype} ({why}; pass --dtype to override)",
              file=sys.stderr, flush=True)
    return dtype
