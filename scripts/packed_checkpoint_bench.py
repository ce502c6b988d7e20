"""What an AWQ or GPTQ checkpoint's packed weights buy on this CPU: the same model run from its
packed 4-bit weights, from its dequantized weights in fp32, and in bf16, alternated in rounds.

Without a quantized checkpoint at hand (nothing is downloaded here), it writes one: the
model's decoder linears rounded to nearest at ``--group-size`` and packed as AutoAWQ (or
AutoGPTQ) lays them out (cadence/testing/packed_checkpoint.py), beside the folder of the dequantized
weights. Rounding to nearest is not AWQ's search for scales, but speed depends only on the
layout, which is the same.

    python scripts/packed_checkpoint_bench.py [--model FOLDER] [--method awq] \\
        [--group-size 64] [--rounds 3] [--input-len 512] [--output-len 256] \\
        [--num-prompts 1] [--out DIR] [--output-json FILE] [--memory]

``--memory``: instead, each of the three loaded in a process of its own (in-process
forward, a 0.25 GiB KV cache), its peak and settled resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_MEMORY = """
import resource, sys
from cadence import LLM
model, dtype = sys.argv[1:]
llm = LLM(model=model, dtype=dtype, max_model_len=2048, backend="cpu",
          backend_options={"overlap": "sync", "kv_cache_gb": 0.25})
now = next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmRSS")) // 1024
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
quantized = llm.engine.backend.env_info().get("cpu_quantized_linears")
print(f"{model} ({dtype}): peak {peak} MiB, settled {now} MiB, {quantized} linears packed")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--method", default="awq", choices=("awq", "gptq", "compressed-tensors"))
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--out", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--memory", action="store_true", help="resident memory, not speed")
    ns = p.parse_args()

    from cadence import EngineArgs
    from cadence.testing.packed_checkpoint import write_packed

    source = EngineArgs(model=ns.model).resolve_model()
    out = Path(ns.out or tempfile.mkdtemp(prefix="cadence-packed-"))
    packed, plain = out / f"{ns.method}-packed", out / f"{ns.method}-dequantized"
    if not packed.is_dir():
        print(f"writing {ns.method} and dequantized copies of {source} into {out}")
        write_packed(source, out, ns.method, 4, group=ns.group_size)
    runs = {"packed": [str(packed)], "fp32": [str(plain), "--dtype", "float32"],
            "bf16": [str(plain), "--dtype", "bfloat16"]}
    names = list(runs)
    if ns.memory:
        for name in names:
            model, *extra = runs[name]
            dtype = extra[1] if extra else "auto"
            subprocess.run([sys.executable, "-c", _MEMORY, model, dtype], check=True)
        return 0
    results: dict[str, list[float]] = {n: [] for n in names}
    records = []
    for r in range(ns.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                model, *extra = runs[name]
                subprocess.run(["engine", "bench", "throughput", "--model", model, *extra,
                                "--num-prompts", str(ns.num_prompts), "--input-len",
                                str(ns.input_len), "--output-len", str(ns.output_len),
                                "--disable-tqdm", "--output-json", f.name], check=True,
                               stdout=subprocess.DEVNULL)
                rec = json.loads(Path(f.name).read_text())
            tps = rec["output_tokens_per_s"]
            results[name].append(tps)
            records.append({"round": r, "run": name, **rec})
            print(f"round {r}: {name:6s} {tps:8.1f} output tok/s")
    print(f"machine: {records[0]['machine']}")
    for name in names:
        print(f"{name:6s} median {statistics.median(results[name]):8.1f} output tok/s "
              f"({', '.join(f'{v:.1f}' for v in results[name])})")
    for other in ("fp32", "bf16"):
        ratios = [a / b for a, b in zip(results["packed"], results[other], strict=True)]
        print(f"packed / {other}: median {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{v:.2f}' for v in ratios)}, per round)")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"runs": records, "config": vars(ns)},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
