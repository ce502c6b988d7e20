"""The CPU backend's decode attention kernel over the decode steps of the default model's
geometry (docs/backends/cpu.md, "Decode attention").

    python scripts/cpu_attention_bench.py [--shapes 64:192,4:512,1:2048] [--rounds 7]
                                          [--dtype float32] [--against CSRC]

A shape is batch:context. Each of the 30 layers has its own K/V cache with every
sequence's blocks scattered over it at random, so the reads come from memory as in a real
step rather than from cache as in a one-layer loop. Reports the median and best round
(milliseconds for the 30 layers of one step) and the K/V bytes read per second.

``--against`` builds the kernels a second time from another version's csrc folder, e.g.

    mkdir -p /tmp/before && git archive cb6b571 backends/cpu/csrc | tar -x -C /tmp/before
    python scripts/cpu_attention_bench.py --against /tmp/before/backends/cpu/csrc

and alternates the two builds pass by pass on the same inputs (which goes first swaps every
round), so a noisy host's drift falls on both alike; it also checks that the two give the
same bits on every layer.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cadence.backends.cpu.kernels import cflags, load_kernels
from cadence.bench.report import machine_info, machine_line

# SmolLM2-135M: 9 query heads, 3 KV heads of 64 dimensions, 30 layers; the engine's
# default block size.
HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def step_inputs(batch: int, context: int, dtype: torch.dtype, g: torch.Generator):
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
               torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype))
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, caches, tables, lens


def build_from(csrc: Path):
    """The kernels of another version's csrc folder, as a module of another name."""
    from torch.utils.cpp_extension import load

    build = tempfile.mkdtemp(prefix="cadence_kernels_against_")
    print(f"building the kernels of {csrc} in {build}", flush=True)
    return load(name="cadence_cpu_kernels_against",
                sources=[str(p) for p in sorted(csrc.glob("*.cpp"))], build_directory=build,
                extra_cflags=cflags(), extra_ldflags=["-fopenmp"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64:192,4:512,1:2048")
    ap.add_argument("--rounds", type=int, default=7, help="timed passes per build (>= 1)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--against", type=Path, metavar="CSRC",
                    help="another version's backends/cpu/csrc folder to alternate with")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    dtype = getattr(torch, args.dtype)
    ops = load_kernels()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available here "
                         "(CADENCE_CPU_KERNELS=0, or no C++ compiler)")
    builds = {"this": ops}
    if args.against is not None:
        builds = {"against": build_from(args.against), "this": ops}
    print(machine_line({**machine_info(), "dtype": args.dtype}))
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split(":"))
        q, caches, tables, lens = step_inputs(batch, context, dtype, g)
        times: dict[str, list[float]] = {name: [] for name in builds}
        outs: dict[str, list[torch.Tensor]] = {name: [] for name in builds}
        for r in range(args.rounds + 1):  # the first warms the thread pool and the pages
            order = list(builds.items())
            if r % 2:
                order.reverse()
            for name, mod in order:
                t = time.perf_counter()
                for k, v in caches:
                    # Six arguments: what every version of the binding accepts.
                    out = mod.paged_decode_attention(q, k, v, tables, lens, scale)
                    if r == 0:
                        outs[name].append(out)
                if r:
                    times[name].append(time.perf_counter() - t)
        kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * q.element_size()
        line = f"batch {batch:3d} x {context:5d} tokens:"
        for name, ts in times.items():
            med = statistics.median(ts)
            label = f" {name}" if len(builds) > 1 else ""
            line += (f"{label} median {med * 1e3:7.2f} ms, best {min(ts) * 1e3:7.2f} ms "
                     f"({kv_bytes / med / 1e9:5.1f} GB/s of K/V);")
        if len(builds) > 1:
            ratio = statistics.median(times["against"]) / statistics.median(times["this"])
            same = all(torch.equal(a, b) for a, b in zip(outs["against"], outs["this"],
                                                          strict=True))
            line += f" against/this {ratio:.2f}x, same bits on every layer: {same}"
        print(line.rstrip(";") + f"  (per step of {LAYERS} layers)")


if __name__ == "__main__":
    main()
