"""Where the CPU backend's time goes on the headline workload: every compiled kernel and GEMM
timed in process (docs/performance.md).

    python scripts/cpu_step_profile.py [--num-prompts 64] [--input-len 128]
                                       [--output-len 128 | --output-len-range 16:64]
                                       [--dtype float32] [--huge-pages off|weights|all]
                                       [--quantization gguf]

Runs the workload once with the ``sync`` strategy (everything on one thread, so a kernel's
wall time is its cost) after a short warm-up, with a timer around each kernel call and
each GEMM (named by its shape; "prefill" where it has more rows than requests), and
around torch.softmax and torch.cat. Prints seconds per entry, the GEMMs' GFLOP/s and what
is left outside the timed calls (other torch ops, Python, scheduling, output processing).
"""

import argparse
import collections
import random
import time

import torch

from cadence import LLM, SamplingParams
from cadence.backends.cpu import gated
from cadence.backends.cpu import kernels as cpu_kernels
from cadence.backends.cpu import linear as cpu_linear
from cadence.backends.cpu import quantized as cpu_quantized
from cadence.backends.cpu.memory import HUGE_PAGE_CHOICES
from cadence.bench.report import machine_info, machine_line
from cadence.bench.throughput import Workload, parse_len_range
from cadence.quantization import QUANTIZATIONS

KERNELS = ("paged_decode_attention", "prefill_attention", "rms_norm", "add_rms_norm",
           "silu_and_mul", "write_kv", "rotary_inplace", "refine_top_logits",
           "draw_from_logits")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-range", default=None,
                    help="A:B: each request's output length drawn as `engine bench` draws it")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--huge-pages", choices=HUGE_PAGE_CHOICES, default="off")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    args = ap.parse_args()
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    flops = [0.0]

    def timed(name, fn):
        def run(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            seconds[name] += time.perf_counter() - t
            calls[name] += 1
            return out
        return run

    ops = cpu_kernels.load_kernels()
    if ops is not None:
        for name in KERNELS:
            setattr(ops, name, timed(name, getattr(ops, name)))
    # The gated modules inherit their GEMM's (timed) _gemm.
    for cls in (cpu_linear.PackedLinear, cpu_linear.TiledLinear, cpu_linear.BrgemmLinear,
                cpu_linear.AmxLinear):
        original = cls.__dict__.get("_gemm", cls._gemm)

        def gemm(self, x, _run=original):
            phase = "prefill" if x.shape[0] > args.num_prompts else "decode"
            fused = isinstance(self, (gated.TiledGatedLinear, gated.AmxGatedLinear))
            width = self.out_features * (2 if fused else 1)
            flops[0] += 2 * x.shape[0] * self.in_features * width
            return timed(f"gemm {self.in_features}->{width} {phase}", _run)(self, x)
        cls._gemm = gemm
    original_q = cpu_quantized.QuantTiledLinear.forward

    def quant_forward(self, x, _run=original_q):
        phase = "prefill" if x.shape[0] > args.num_prompts else "decode"
        width = self.out_features * (2 if self.variant else 1)
        flops[0] += 2 * x.shape[0] * self.in_features * width
        return timed(f"gemm {self.in_features}->{width} {phase} (quantized)", _run)(self, x)
    cpu_quantized.QuantTiledLinear.forward = quant_forward
    # The two torch ops of the step that showed in a profile: softmax (sampling's, where the
    # draw kernel is not used) and the concatenations (row padding, penalties' history).
    for name in ("softmax", "cat"):
        setattr(torch, name, timed(f"torch.{name}", getattr(torch, name)))
    llm = LLM(dtype=args.dtype, quantization=args.quantization, backend="cpu",
              backend_options={"overlap": "sync", "huge_pages": args.huge_pages})
    print(machine_line({**machine_info(), "dtype": args.dtype}))
    rng = random.Random(0)

    def prompts(n):
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
                for _ in range(n)]

    llm.generate(prompts(4), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    seconds.clear()
    calls.clear()
    flops[0] = 0.0
    span = parse_len_range(args.output_len_range)
    lens = Workload(input_len=args.input_len, output_len=args.output_len,
                    num_prompts=args.num_prompts, output_len_range=span).output_lens()
    shape = f"{span[0]}..{span[1]}" if span else f"{args.output_len}"
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0) for n in lens]
    t = time.perf_counter()
    llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
    wall = time.perf_counter() - t
    timed_total = sum(seconds.values())
    gemm_s = sum(s for name, s in seconds.items() if name.startswith("gemm"))
    print(f"{wall:.2f} s for {args.num_prompts} x {args.input_len} in / {shape} out")
    for name in sorted(seconds, key=seconds.get, reverse=True):
        print(f"  {name:36s} {seconds[name]:7.2f} s  {calls[name]:6d} calls")
    print(f"  {'GEMMs together':36s} {gemm_s:7.2f} s  ({flops[0] / gemm_s / 1e9:.1f} GFLOP/s)")
    print(f"  {'outside the timed calls':36s} {wall - timed_total:7.2f} s")


if __name__ == "__main__":
    main()
