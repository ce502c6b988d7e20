"""Time to first token of one long prompt alone, on one engine, with and without pipeline
parallel (docs/distributed.md, "A long prompt fills the pipeline").

    python scripts/pp_long_prompt_ttft.py PIPELINE_STAGES BUDGET PROMPT_TOKENS [MODEL]

Builds the engine (the built-in default model unless MODEL is given), prefills one
untimed prompt, then times three prompts of PROMPT_TOKENS token ids each, one at a time,
with max_tokens=1 and --max-num-batched-tokens BUDGET, and prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

from cadence import LLM, SamplingParams


def main() -> None:
    stages, budget, n = (int(a) for a in sys.argv[1:4])
    model = sys.argv[4] if len(sys.argv) > 4 else None
    llm = LLM(model=model, pipeline_parallel_size=stages, max_num_batched_tokens=budget,
              max_model_len=max(4096, n + 1))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt(seed: int) -> dict:  # no shared prefix: the prefix cache gives nothing
        return {"prompt_token_ids": [(7 * i + 3 + 11 * seed) % 40000 + 10 for i in range(n)]}

    try:
        llm.generate([prompt(99)], params, use_tqdm=False)
        times, token = [], None
        for k in range(3):
            t = time.perf_counter()
            out = llm.generate([prompt(k)], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            token = out[0].outputs[0].token_ids[0]
    finally:
        llm.shutdown()
    print(json.dumps({"pipeline_parallel_size": stages, "max_num_batched_tokens": budget,
                      "prompt_tokens": n, "seconds": times, "first_token": token}))


if __name__ == "__main__":
    main()
