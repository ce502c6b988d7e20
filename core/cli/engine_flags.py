"""The engine's command-line flags, one per ``EngineArgs`` field (``engine generate``,
``chat``, ``serve`` and ``bench`` share them), plus each plugin's."""

from __future__ import annotations

import argparse

from cadence.config import (
    DEFAULT_MAX_WORKER_RESTARTS,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    DTYPES,
    EXECUTOR_BACKENDS,
    EXPERT_PLACEMENTS,
    POLICIES,
    RAY_PLACEMENT_STRATEGIES,
)
from cadence.pooling.config import POOLING_TYPES
from cadence.quantization import QUANTIZATIONS


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model", default=None,
                   help="model folder, GGUF file, or Hugging Face Hub id org/name "
                        "(default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub model id (default: main)")
    # None, not "cpu": the command line says whether the backend was asked for.
    p.add_argument("--backend", default=None,
                   help="backend name (see engine backends), or 'auto' for the best "
                        "available one (default: cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES,
                   help="weights and activations dtype; auto: the backend's choice "
                        "(docs/backends/)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="keep the weights compressed in memory: 'gguf' runs a GGUF "
                        "model's linear weights from their own blocks, with the outputs "
                        "of its fp32 weights; 'int8' rounds any model's linears to int8 "
                        "at load; 'awq', 'gptq', 'compressed-tensors' run such a "
                        "checkpoint's packed weights "
                        "(docs/quantization.md; default: the checkpoint's own "
                        "quantization_config, else off)")
    p.add_argument("--seed", type=int, default=0,
                   help="the engine's random seed")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: sized by the backend from free memory)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false",
                   help="turn off prefix caching (on by default)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences scheduled in one step")
    p.add_argument("--max-num-samples", type=int, default=256,
                   help="largest n (samples of one request) the engine accepts; larger "
                        "is refused (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: max(8192, max_model_len "
                        "without chunked prefill))")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false",
                   help="prefill each prompt in one step (chunked prefill is on by "
                        "default)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="order in which waiting requests are admitted")
    p.add_argument("--disable-async-output-proc", action="store_true",
                   help="run the output work right after sampling instead of overlapping "
                        "it with the next step (outputs are identical; default: off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="plan each step while the previous one computes, with placeholders "
                        "the backend fills on the device (outputs are identical; backends "
                        "that support it: see docs/async_scheduling.md; default: the "
                        "backend's choice, on for cuda, off elsewhere)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the model folder)")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="sampling defaults (temperature, top_p, top_k, min_p, "
                        "repetition_penalty) for fields a request leaves out: 'auto' reads "
                        "the model folder's generation_config.json, a folder reads that "
                        "folder's, 'none' (or vLLM's 'vllm') ignores it "
                        "(default: %(default)s)")
    p.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds a step may take before its worker counts as frozen and "
                        "is restarted; inf for no limit (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   help="seconds a worker process or rank may take to load the model "
                        "and build its kernels before it counts as stuck and the start "
                        "fails; inf for no limit (default: %(default)s)")
    p.add_argument("--max-worker-restarts", type=int,
                   default=DEFAULT_MAX_WORKER_RESTARTS,
                   help="restarts of a lost or frozen worker before the engine stops "
                        "serving (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks, one process each "
                        "(docs/distributed.md; default: %(default)s)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the model's layers over this many stages, one process "
                        "each, with as many micro-batches in flight "
                        "(docs/distributed.md; default: %(default)s)")
    p.add_argument("--distributed-executor-backend", default=None,
                   choices=EXECUTOR_BACKENDS,
                   help="what runs the ranks: 'uniproc' (the backend in this process), "
                        "'mp' (one worker process per rank on this host) or 'ray' "
                        "(default: mp when the model is split over several ranks, else "
                        "uniproc)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: each tensor-parallel rank holds whole "
                        "experts instead of a slice of every expert "
                        "(docs/distributed.md)")
    p.add_argument("--expert-placement-strategy", default="linear",
                   choices=EXPERT_PLACEMENTS,
                   help="which experts a rank holds under expert parallel: 'linear' (a "
                        "contiguous run each) or 'round_robin' (every N-th) "
                        "(default: %(default)s)")
    p.add_argument("--ray-placement-strategy", default="PACK",
                   choices=RAY_PLACEMENT_STRATEGIES,
                   help="--distributed-executor-backend ray: how the ranks (one Ray "
                        "placement group bundle each: a CPU, plus the backend's GPU or "
                        "HPU) share the cluster's nodes: PACK on as few nodes as "
                        "possible, SPREAD on as many as possible (both best effort), "
                        "STRICT_PACK all on one node, STRICT_SPREAD each on a node of its "
                        "own; start-up fails if the cluster cannot place them within "
                        "--startup-timeout (default: %(default)s)")
    p.add_argument("--pooling-type", default=None, choices=POOLING_TYPES,
                   help="embeddings: pool the last prompt token's final hidden state, "
                        "the mean over the prompt, or the first token's (default: the "
                        "model folder's sentence-transformers Pooling module, else last)")
    p.add_argument("--pooling-normalize", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="embeddings: scale each to unit L2 norm (default: as the model "
                        "folder's sentence-transformers modules say, else on)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders): per request through "
                        "lora_request, on the server through --lora-modules and the "
                        "model field (docs/semantics.md, \"LoRA adapters\")")
    p.add_argument("--max-loras", type=int, default=1,
                   help="most distinct adapters in one step; requests for others wait "
                        "(default: %(default)s)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank accepted (default: %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded, least recently used dropped first "
                        "(default: --max-loras)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}' (docs/speculative_decoding.md; "
                        "outputs are identical; default: off)")
    from cadence.plugins import get_registry

    get_registry().hook.cadence_add_cli_options(parser=parser)
