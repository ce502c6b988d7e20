"""The CPU backend's GEMM candidates over one decode step of the default model's weights
(docs/backends/cpu.md, "The fp32 tiled GEMM").

    python scripts/cpu_gemm_bench.py [--rows 2,16,64,2048] [--rounds 5] [--dtype float32]

Each layer has its own weights (30 layers of SmolLM2-135M's four GEMMs and the LM head), so
they stream from memory as in a real step rather than sitting in cache as in a one-shape
loop. Candidates run alternately, round after round, through the modules the engine builds
(row padding included); the best round of each is reported.
"""

import argparse
import time

import torch

from cadence.backends.cpu import linear as cpu_linear
from cadence.backends.cpu import linear_choice
from cadence.bench.report import machine_info, machine_line

# SmolLM2-135M: qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576; 30 layers;
# LM head 576 -> 49152.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)


def candidates(dtype: torch.dtype) -> list[str]:
    out = ["torch"]
    if cpu_linear.packed_available() and (dtype == torch.float32 or
                                          cpu_linear.packed_bf16_available()):
        out.append("packed")
    if dtype == torch.float32 and cpu_linear.tiled_ops() is not None:
        out.append("tiled")
    if dtype == torch.bfloat16 and cpu_linear.brgemm_ops() is not None:
        out.append("brgemm")
    if dtype == torch.bfloat16 and cpu_linear.amx_ops() is not None:
        out.append("amx")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,16,64,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(machine_line({**machine_info(), "dtype": args.dtype}))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
               for _ in range(LAYERS) for n, k in LAYER]
    weights.append((torch.randn(*HEAD, generator=g) * HEAD[1] ** -0.5).to(dtype))
    names = candidates(dtype)
    modules = {c: [linear_choice._gemm_of(c)(w) for w in weights] for c in names}
    for rows in (int(r) for r in args.rows.split(",")):
        widths = {w.shape[1] for w in weights}
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in widths}
        flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
        best = dict.fromkeys(names, float("inf"))
        with torch.no_grad():
            for _ in range(args.rounds):
                for c in names:
                    t = time.perf_counter()
                    for mod in modules[c]:
                        mod(xs[mod.in_features])
                    best[c] = min(best[c], time.perf_counter() - t)
        base = best.get("packed", best["torch"])
        print(f"rows {rows:5d}: " + "  ".join(
            f"{c} {best[c] * 1e3:8.1f} ms ({flops / best[c] / 1e9:5.1f} GFLOP/s, "
            f"{base / best[c]:.2f}x)" for c in names))


if __name__ == "__main__":
    main()
