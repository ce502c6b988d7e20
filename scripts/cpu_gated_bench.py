"""The default model's gate/up GEMM with SiLU-and-mul fused into it (backends/cpu/gated.py)
against the unfused pair, tiled_linear then silu_and_mul (docs/backends/cpu.md).

    python scripts/cpu_gated_bench.py [--rows 64,2048] [--rounds 15]

Each row count runs over layers of their own weights (30 at 64 rows, 4 at more: streamed
from memory as in a real step), the two alternated round by round, which goes first
swapping; reports the median per layer and the median of the per-round ratios, and checks
that both give the same bits.
"""

import argparse
import statistics
import time

import torch

from cadence.backends.cpu.kernels import load_kernels
from cadence.bench.report import machine_info, machine_line

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,2048")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    ops = load_kernels()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available here "
                         "(CADENCE_CPU_KERNELS=0, or no C++ compiler)")
    print(machine_line({**machine_info(), "dtype": "float32"}))
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        layers = 30 if rows <= 256 else 4
        weights = [torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
                   for _ in range(layers)]
        plain = [ops.tiled_pack(w) for w in weights]
        fused = [ops.tiled_pack_gated(w) for w in weights]
        x = torch.randn(rows, HIDDEN, generator=g)

        def unfused_pass(plain=plain, x=x) -> torch.Tensor:
            for p in plain:
                out = ops.silu_and_mul(ops.tiled_linear(x, p, 2 * INTERMEDIATE))
            return out

        def fused_pass(fused=fused, x=x) -> torch.Tensor:
            for p in fused:
                out = ops.tiled_linear_gated(x, p, INTERMEDIATE)
            return out

        same = torch.equal(unfused_pass(), fused_pass())
        times: dict[str, list[float]] = {"unfused": [], "fused": []}
        for r in range(args.rounds):
            order = [("unfused", unfused_pass), ("fused", fused_pass)]
            for name, run in order if r % 2 else order[::-1]:
                t = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - t) / layers)
        u, f = (statistics.median(times[k]) for k in ("unfused", "fused"))
        ratio = statistics.median(a / b for a, b in zip(times["unfused"], times["fused"],
                                                         strict=True))
        print(f"{rows:5d} rows: unfused {u * 1e3:8.3f} ms, fused {f * 1e3:8.3f} ms a layer; "
              f"unfused/fused {ratio:.3f} (median of rounds); same bits: {same}")


if __name__ == "__main__":
    main()
