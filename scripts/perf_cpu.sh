#!/usr/bin/env bash
# Regenerates the CPU figures of docs/performance.md (about 30 minutes on 2 cores).
# Run on a quiet machine: the benchmarks share the CPU with anything else running.
set -euo pipefail
dest=${1:-docs/perf}
mkdir -p "$dest"
# Headline: the workload vLLM CPU was measured on (64 x 128 in / 128 out, fp32).
engine bench compare --num-prompts 64 --input-len 128 --output-len 128 --batch-sizes 64 \
    --runs async,sync,floor,hf_generate --breakdown --disable-tqdm \
    --output-json "$dest/headline.json" --chart "$dest/headline.png"
# 256 requests with mixed output lengths against transformers' generate and generate_batch.
engine bench compare --num-prompts 256 --input-len 32 --output-len-range 16:64 \
    --batch-sizes 256 --runs async,sync,floor,hf_generate,hf_generate_batch --disable-tqdm \
    --output-json "$dest/mixed256.json" --chart "$dest/mixed256.png"
# Batch-size sweep, async vs sync vs the floor.
engine bench compare --input-len 32 --output-len 64 --waves 1 \
    --batch-sizes 1,8,32,64,128,256 --runs async,sync,floor --breakdown --disable-tqdm \
    --output-json "$dest/sweep_batch.json" --chart "$dest/sweep_batch.png"
