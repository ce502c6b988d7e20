#!/usr/bin/env bash
# Runs the CPU backend as an AVX2-only CPU (Zen 3 class) would, on a CPU with AVX-512:
# torch's kernels at ATEN_CPU_CAPABILITY=avx2, oneDNN's GEMMs at ONEDNN_MAX_CPU_ISA=AVX2, and
# cadence's own kernels compiled for x86-64-v3 (docs/backends/cpu.md, "Checking another
# instruction set"). First the exactness tests of the CPU kernels and the engine, then,
# unless --tests-only, the headline workload at the capped level and at the machine's own,
# alternated, fp32 both (--bench-only skips the tests).
#
#   bash scripts/isa_check.sh [--tests-only|--bench-only] [DEST_DIR]
set -euo pipefail
tests_only=0 bench_only=0
if [[ "${1:-}" == "--tests-only" ]]; then tests_only=1; shift; fi
if [[ "${1:-}" == "--bench-only" ]]; then bench_only=1; shift; fi
dest=${1:-isa-check}
mkdir -p "$dest"
capped=(env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)
"${capped[@]}" python - <<'PY'
from cadence.cpuinfo import describe
d = describe()
assert d.get("isa_limit") == "avx2" and not any(f.startswith("avx512") for f in d["cpu_flags"]), d
print("capped machine block:", d)
PY
if [[ $bench_only == 0 ]]; then
    "${capped[@]}" python -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py \
        tests/test_cpu_prefill_attention.py tests/test_sliding_window_kernels.py \
        tests/test_logits_precision.py tests/test_engine_parity.py \
        tests/test_cpu_quant_linear.py tests/test_quantization.py | tee "$dest/tests_avx2.txt"
fi
[[ $tests_only == 1 ]] && exit 0
for round in 1 2; do
    for level in avx2 native; do
        run=(engine bench throughput --num-prompts 64 --input-len 128 --output-len 128
             --dtype float32 --disable-tqdm --output-json "$dest/headline_${level}_r$round.json")
        if [[ $level == avx2 ]]; then "${capped[@]}" "${run[@]}"; else "${run[@]}"; fi
    done
done
python - "$dest" <<'PY'
import json, pathlib, sys
dest = pathlib.Path(sys.argv[1])
for level in ("avx2", "native"):
    figs = [json.loads(p.read_text()) for p in sorted(dest.glob(f"headline_{level}_r*.json"))]
    tps = [round(f["output_tokens_per_s"], 1) for f in figs]
    print(level, "output tok/s per round:", tps)
PY
