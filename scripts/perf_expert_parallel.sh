#!/usr/bin/env bash
# Expert parallel against tensor parallel on a random-weight mixture of experts (docs/
# distributed.md, "Expert parallel"): the same TP=2 engine with each expert split over the
# two ranks, then with whole experts per rank, alternating, ROUNDS times each (default 3),
# plus one process for scale. About 5 minutes on 2 cores; run on a quiet machine.
set -euo pipefail
dest=${1:-docs/perf/expert_parallel}
rounds=${2:-3}
model=${MOE_MODEL:-/tmp/cadence-moe-64x8}
mkdir -p "$dest"
# 8 layers, hidden 512, 64 experts of width 192 per layer, 8 per token (Qwen3-30B-A3B's
# proportions, shrunk): ~190 M parameters, 709 MB in fp32.
[ -f "$model/config.json" ] || engine bench make-small-model --output "$model" \
    --num-layers 8 --hidden-size 512 --num-experts 64 --experts-per-token 8
workload=(--model "$model" --num-prompts 64 --input-len 128 --output-len 64 --disable-tqdm)
for r in $(seq 1 "$rounds"); do
    engine bench throughput "${workload[@]}" -tp 2 --output-json "$dest/tp2_r$r.json"
    engine bench throughput "${workload[@]}" -tp 2 --enable-expert-parallel \
        --output-json "$dest/tp2_ep_r$r.json"
done
engine bench throughput "${workload[@]}" --output-json "$dest/tp1.json"
