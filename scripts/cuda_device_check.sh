#!/usr/bin/env bash
# One prepared check of the CUDA backend on a GPU machine (H100/H200 class): environment
# facts, the GPU tests, `engine bench compare`, and a direct timing loop through cadence.LLM
# so numbers come back even if the bench command is not there.
#
#   bash scripts/cuda_device_check.sh [RESULTS_DIR]     (about ten minutes)
#
# It assumes a bare, offline machine whose python3 already has torch (CUDA), triton,
# transformers, tokenizers, safetensors, pluggy and pytest,
# so cadence is installed with --no-deps --no-index. Each stage has its own time limit, cut
# to what is left of BUDGET_S (570 s), and the stages run most-valuable-first (correctness,
# then the overlap timings, then the bench command); STAGES selects some of them.
# Results (eight files) land in RESULTS_DIR (default ./cuda-check-results):
#   env.txt  pytest.log  bench.log  bench.json  timing.log  timing.json  summary.txt
set -u -o pipefail
results="${1:-cuda-check-results}"
mkdir -p "$results"
STAGES="${STAGES:-env,install,model,tests,timing,bench}"
BATCHES="${BATCHES:-1,8,32,64,128,256}"
MODEL_DIR="${MODEL_DIR:-/tmp/cadence-llama-1b}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
has() { [[ ",$STAGES," == *",$1,"* ]]; }
say() { echo "== $(date +%T) $*" | tee -a "$results/summary.txt"; }
# One deadline for the whole run (BUDGET_S; set it below whatever limit the job runs under):
# each stage gets min(its own limit, what is left), so a slow stage cannot starve the rest
# of time to write their results, and a stage with under 20 s left is skipped.
BUDGET_S="${BUDGET_S:-570}"
DEADLINE=$(( $(date +%s) + BUDGET_S ))
left() { local l=$(( DEADLINE - $(date +%s) - 5 )); (( l < $1 )) && echo "$l" || echo "$1"; }
fits() { (( $(left 9999) >= 20 )) || { say "skipped $1: out of time"; return 1; }; }

if has env; then
  say "env"
  { nvidia-smi; "$PY" -c 'import sys, torch, triton, transformers
print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0)); print("triton", triton.__version__)
print("transformers", transformers.__version__)'; } >"$results/env.txt" 2>&1
  tail -4 "$results/env.txt" | tee -a "$results/summary.txt"
fi

if has install; then
  say "install cadence (no deps, offline)"
  "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . >>"$results/env.txt" 2>&1 \
    || "$PY" -m pip install -q --no-deps --no-index --no-build-isolation . >>"$results/env.txt" 2>&1 \
    || say "pip install failed (see env.txt)"
  "$PY" -c 'from cadence.backends.cuda.backend import CudaBackend as C; print(C.probe())' \
    2>&1 | tee -a "$results/summary.txt"
fi

if has model && fits model; then
  say "build a ~1.1B Llama-shaped random-weight model (TinyLlama shape) in $MODEL_DIR"
  timeout "$(left 180)" "$PY" - "$MODEL_DIR" <<'EOF' 2>&1 | tee -a "$results/summary.txt"
import os, shutil, sys
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
sys.path.insert(0, "tests")
import model_factory
out = sys.argv[1]
if os.path.exists(os.path.join(out, "model.safetensors")):
    print("exists"); sys.exit(0)
os.makedirs(out, exist_ok=True)
model_factory.build_tokenizer(out)  # small BPE; the timing loop feeds token ids directly
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
                  architectures=["LlamaForCausalLM"])
cfg.save_pretrained(out)
g = torch.Generator(device="cuda").manual_seed(0)
def rnd(*shape):
    return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()
h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * 64
w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "lm_head.weight": rnd(cfg.vocab_size, h),
     "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
for l in range(cfg.num_hidden_layers):
    p = f"model.layers.{l}."
    w |= {p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
          p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
          p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
          p + "mlp.down_proj.weight": rnd(h, i),
          p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
          p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
print("params", sum(t.numel() for t in w.values()) / 1e9, "B")
EOF
fi

if has tests && fits tests; then
  say "GPU tests"
  timeout "$(left 200)" "$PY" -m pytest tests/test_cuda_gpu.py tests/test_cuda_kernels.py \
    tests/test_cuda_logic.py -q -rs -x >"$results/pytest.log" 2>&1
  echo "pytest exit $?" | tee -a "$results/summary.txt"
  tail -5 "$results/pytest.log" | tee -a "$results/summary.txt"
fi

if has timing; then
  # One process per setting: each engine takes 0.9 of the card for its KV cache.
  for setting in async sync eager; do
    fits "timing $setting" || break
    say "timing loop: $setting (batches $BATCHES)"
    timeout "$(left 150)" "$PY" - "$MODEL_DIR" "$setting" "$BATCHES" "$results/timing.json" <<'EOF' \
      2>&1 | tee -a "$results/timing.log" | grep -E '^(RESULT|Traceback|[A-Za-z]*Error)' \
      | tee -a "$results/summary.txt"
import json, os, random, sys, time
import torch
from cadence import LLM, SamplingParams
from cadence.backends.cuda.graphs import bucket_for
model, setting, batches, out_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
IN, OUT_LEN = 128, 128
llm = LLM(model=model, backend="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=256,
          disable_async_output_proc=setting == "sync",
          backend_options={"enforce_eager": setting == "eager"})
be = llm.engine.backend
rng = random.Random(0)
def prompts(n):
    return [{"prompt_token_ids": [rng.randrange(2, 800) for _ in range(IN)]}
            for _ in range(n)]
def run(n, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False)
    ps = prompts(n)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)
run(4, 8)  # warm-up: first Triton compiles, allocator growth
results = []
for b in [int(x) for x in batches.split(",")]:
    prefill_s, _ = run(b, 1)
    total_s, ntok = run(b, OUT_LEN)
    decode_s = max(total_s - prefill_s, 1e-9)
    row = {"setting": setting, "batch": b, "output_tokens": ntok, "total_s": total_s,
           "tok_per_s": ntok / total_s, "decode_tok_per_s": b * (OUT_LEN - 1) / decode_s}
    bucket = bucket_for(b, be.graphs.sizes) if be.graphs is not None else None
    if bucket is not None:  # the floor: the decode graph alone, replayed back to back
        be.graphs.views.slot_mapping.fill_(-1)  # write no KV while timing
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            be.graphs.replay(bucket)
        start.record()
        for _ in range(20):
            be.graphs.replay(bucket)
        end.record(); end.synchronize()
        step_s = start.elapsed_time(end) / 20 / 1000
        row |= {"floor_step_ms": step_s * 1000, "floor_tok_per_s": b / step_s,
                "ratio_to_floor": row["decode_tok_per_s"] / (b / step_s),
                "gpu_idle_fraction_est": max(0.0, 1 - (OUT_LEN - 1) * step_s / decode_s)}
    results.append(row)
    print("RESULT", json.dumps(row), flush=True)
llm.shutdown()
old = json.load(open(out_path)) if os.path.exists(out_path) else []
json.dump(old + results, open(out_path, "w"), indent=1)
EOF
  done
  [[ -f "$results/timing.json" ]] && "$PY" - "$results/timing.json" <<'EOF' 2>&1 | tee -a "$results/summary.txt"
import json, sys
rows = json.load(open(sys.argv[1]))
by = {(r["setting"], r["batch"]): r for r in rows}
print(f"{'batch':>5} {'async tok/s':>11} {'sync tok/s':>10} {'on/off':>6} {'eager tok/s':>11} "
      f"{'decode/floor':>12} {'idle est':>8}")
for b in sorted({r["batch"] for r in rows}):
    a, s, e = by.get(("async", b), {}), by.get(("sync", b), {}), by.get(("eager", b), {})
    ratio = a.get("decode_tok_per_s", 0) / s["decode_tok_per_s"] if s else float("nan")
    print(f"{b:>5} {a.get('decode_tok_per_s', 0):>11.0f} {s.get('decode_tok_per_s', 0):>10.0f} "
          f"{ratio:>6.3f} {e.get('decode_tok_per_s', 0):>11.0f} "
          f"{a.get('ratio_to_floor', float('nan')):>12.3f} "
          f"{a.get('gpu_idle_fraction_est', float('nan')):>8.3f}")
EOF
fi

if has bench && fits bench; then
  say "engine bench compare"
  { engine bench compare --help 2>&1 | head -40
    timeout "$(left 150)" engine bench compare --backend cuda --model "$MODEL_DIR" --dtype bfloat16 \
      --output-json "$results/bench.json" ${BENCH_EXTRA_ARGS:-}
    echo "bench exit $?"; } >"$results/bench.log" 2>&1
  tail -15 "$results/bench.log" | tee -a "$results/summary.txt"
fi
say "done"
