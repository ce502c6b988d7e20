"""``engine bench throughput``: offline throughput in the idiom of vLLM's benchmark_throughput.py.

Random token-id prompts of exactly ``input_len`` tokens (seeded), ``ignore_eos`` so every
request produces exactly its output length, temperature 1.0 / top_p 1.0 (vLLM's choice), the
engine driven directly (``add_request`` + ``step`` loop) behind a progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Any

from cadence.bench.floor import StepTimer, breakdown_from
from cadence.bench.report import env_info, format_table, machine_info, write_json

# Re-exported: the workload's names were this module's before workload.py held them.
from cadence.bench.workload import (  # noqa: F401
    HEAVY_LOGPROBS,
    HEAVY_STOP,
    HOST_WORK,
    STRUCTURED,
    Workload,
    parse_len_range,
    prompt_vocab_size,
    vocab_size_of,
    workload_from_args,
    workload_tokens,
)


def build_engine(ns: argparse.Namespace, **overrides: Any) -> Any:
    """An LLMEngine from the CLI namespace (EngineArgs flags + plugin flags) plus overrides."""
    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs

    args, extra = EngineArgs.from_cli_args(ns)
    args = dataclasses.replace(args, **overrides)
    return LLMEngine.from_engine_args(args, extra)


def release_engine(engine: Any) -> None:
    engine.shutdown()
    del engine
    gc.collect()


WARMUP_TOKENS = 4
# The speculative decoding run's drafts where --speculative-config does not say.
BENCH_SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def bench_loras(engine: Any, count: int) -> list[Any] | None:
    """On an engine that serves LoRA adapters, one per request: ``max_loras`` random
    adapters of rank ``max_lora_rank`` on every projection, written for the engine's model
    once (cadence.testing.adapters), taken in turn. None on an engine without LoRA."""
    cfg = getattr(getattr(engine, "config", None), "lora_config", None)
    if cfg is None:
        return None
    adapters = getattr(engine, "bench_adapters", None)
    if adapters is None:
        import tempfile

        from cadence.lora import LoRARequest
        from cadence.testing.adapters import write_random_lora

        folder = tempfile.TemporaryDirectory(prefix="cadence-bench-lora-")
        model = engine.config.model_config.model
        adapters = [LoRARequest(f"bench-{i}", i + 1, write_random_lora(
            model, f"{folder.name}/{i}", i, cfg.max_lora_rank)) for i in range(cfg.max_loras)]
        engine.bench_adapters, engine.bench_adapter_dir = adapters, folder
    return [adapters[i % len(adapters)] for i in range(count)]


def warmup_prompt(prompt: list[int]) -> list[int]:
    """``prompt`` reversed: the measured prompt's length, and no prefix they share."""
    return list(reversed(prompt))


def warm_up(engine: Any, workload: Workload, prompts: list[list[int]], count: int) -> None:
    """Run ``count`` prompts shaped like the measured ones for a few tokens, untimed.

    The first batch of a new size pays one-time costs (on a GPU: kernel JIT for new shapes,
    the caching allocator growing, library heuristics; measured at ~3.5 s of a 4 s run at
    batch 256), which would otherwise land on whichever run comes first. Each prompt is
    reversed so the prefix cache gives the measured prompts nothing.
    """
    from cadence.output_state import OutputKind

    prompts = prompts[:max(1, count)]
    loras = bench_loras(engine, len(prompts))
    for i, ids in enumerate(prompts):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": warmup_prompt(ids)},
                           workload.sampling_params(WARMUP_TOKENS),
                           output_kind=OutputKind.FINAL_ONLY,
                           **({"lora_request": loras[i]} if loras else {}))
    while engine.has_unfinished_requests():
        engine.step()


def run_engine(engine: Any, workload: Workload, prompts: list[list[int]],
               out_lens: list[int], breakdown: bool = False, progress: bool = True,
               name: str = "async") -> dict[str, Any]:
    """Generate every prompt with the engine; return the throughput record of the run."""
    from cadence.output_state import OutputKind

    timer = StepTimer(engine) if breakdown else None
    phases0 = dict(engine.stats.times.phases)
    steps0 = engine.stats.num_steps
    spec = getattr(getattr(engine, "config", None), "speculative_config", None)
    drafts0 = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens) if spec else 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=f"{name}", dynamic_ncols=True)
    so = workload.sampling_params(1).structured_outputs
    if so is not None:  # xgrammar's import and the one compilation stay out of the timing
        engine.structured.compiler.submit(so).result()
    num_out = 0
    loras = bench_loras(engine, len(prompts))
    start = time.perf_counter()
    try:
        for i, (ids, n) in enumerate(zip(prompts, out_lens)):
            engine.add_request(f"bench-{i}", {"prompt_token_ids": ids},
                               workload.sampling_params(n), output_kind=OutputKind.FINAL_ONLY,
                               **({"lora_request": loras[i]} if loras else {}))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        bar.update(1)
        elapsed = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
        if timer is not None:
            timer.restore()
    num_in = sum(len(p) for p in prompts)
    rec: dict[str, Any] = {
        "name": name,
        "batch_size": engine.config.scheduler_config.max_num_seqs,
        "host_work": workload.host_work,
        "async_output": engine.async_output,
        "async_scheduling": engine.config.async_scheduling,
        "lora_adapters": len(set(loras or ())),
        # Runs of one comparison may differ in both (the quant run's activations are fp32).
        "dtype": getattr(model_config := getattr(engine.config, "model_config", None),
                         "dtype", None),
        "quantization": getattr(model_config, "quantization", None),
        "num_prompts": len(prompts),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "num_steps": engine.stats.num_steps - steps0,
    }
    if spec is not None:
        rec["draft_tokens"] = engine.stats.num_draft_tokens - drafts0[0]
        rec["accepted_tokens"] = engine.stats.num_accepted_tokens - drafts0[1]
    if timer is not None:
        phases = {k: v - phases0.get(k, 0.0) for k, v in engine.stats.times.phases.items()}
        rec["breakdown"] = breakdown_from(phases, engine.stats.num_steps - steps0, elapsed,
                                          timer, finalize_in_execute=engine._loop is None)
    return rec


def print_breakdown(rec: dict[str, Any]) -> None:
    b = rec.get("breakdown")
    if not b:
        return
    rows = [{"phase": k, "total_s": b["phases_s"][k], "per_step_ms": b["per_step_ms"][k],
             "share": b["phases_s"][k] / b["wall_s"] if b["wall_s"] else None}
            for k in b["phases_s"]]
    print(f"\nper-step breakdown of '{rec['name']}' ({b['num_steps']} steps):")
    print(format_table(rows, ["phase", "total_s", "per_step_ms", "share"]))
    print(f"device (forward+sample) {b['device_s']:.3f} s [{b['device_source']}], "
          f"finalize {b['finalize_s']:.3f} s: hidden {b['hidden_finalize_s']:.3f} s, "
          f"exposed {b['exposed_finalize_s']:.3f} s; "
          f"device idle {100 * b['device_idle_fraction']:.1f} % of wall")
    if b.get("exposed_host_per_step_ms") is not None:
        print(f"exposed host time {b['exposed_host_per_step_ms']:.3f} ms/step (the device "
              f"idle between consecutive steps, from the backend's timestamps)")
    if b.get("launch_per_step_ms") is not None:
        print(f"launch latency {b['launch_per_step_ms']:.3f} ms/step (p50 "
              f"{b['launch_p50_ms']:.3f}, p90 {b['launch_p90_ms']:.3f}): the device's wait "
              f"for a step it had been handed, after the step before it ended")


def cmd_throughput(ns: argparse.Namespace) -> int:
    workload = workload_from_args(ns)
    engine = build_engine(ns)
    try:
        prompts = workload.prompts(vocab_size_of(engine), engine.tokenizer)
        name = "async_sched" if engine.config.async_scheduling else \
            "sync" if not engine.async_output else "async"
        warm_up(engine, workload, prompts, engine.config.scheduler_config.max_num_seqs)
        rec = run_engine(engine, workload, prompts, workload.output_lens(), ns.breakdown,
                         not ns.disable_tqdm, name)
        env, machine = env_info(engine), machine_info(engine)
    finally:
        release_engine(engine)
    print(f"Throughput: {rec['requests_per_s']:.2f} requests/s, "
          f"{rec['total_tokens_per_s']:.2f} total tokens/s, "
          f"{rec['output_tokens_per_s']:.2f} output tokens/s "
          f"({rec['num_prompts']} prompts in {rec['elapsed_s']:.2f} s)")
    print_breakdown(rec)
    if ns.output_json:
        write_json(ns.output_json, {**rec, "config": config_of(ns, workload), "env": env,
                                    "machine": machine})
    return 0


def config_of(ns: argparse.Namespace, workload: Workload | None = None) -> dict[str, Any]:
    """The run's flags, JSON-safe (the workload plus every CLI option)."""
    cfg = {k: v for k, v in vars(ns).items() if not callable(v)}
    if workload is not None:
        cfg["workload"] = workload.to_dict()
    return cfg
