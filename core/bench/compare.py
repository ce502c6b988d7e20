"""``engine bench compare`` (async, sync, floor and the transformers baselines on the same
prompts, for each batch size and host-work setting; with ``--rounds N`` interleaved rounds
and paired ratios, see ``cadence.bench.rounds``; with ``--peer`` another engine in
alternating rounds, see ``cadence.bench.peer``) and ``engine bench scale`` (host cost per
step with a short and a long waiting queue)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from cadence.bench.floor import run_floor_of
from cadence.bench.peer import (
    PeerWorkdir,
    async_rounds_with_peer,
    check_peer,
    peer_options,
    print_peer,
)
from cadence.bench.report import draw_chart, env_info, format_table, machine_info, write_json
from cadence.bench.rounds import (
    build_mode_engine,
    interleaved_runs,
    median_records,
    needed_modes,
    paired_summary,
    print_paired,
)
from cadence.bench.throughput import (
    BENCH_SPEC,
    Workload,
    build_engine,
    config_of,
    print_breakdown,
    release_engine,
    run_engine,
    vocab_size_of,
    warm_up,
    workload_from_args,
    workload_tokens,
)

RUN_NAMES = ("async", "async_sched", "sync", "lora", "spec", "quant", "floor", "hf_generate",
             "hf_generate_batch")
# The engine runs: EngineArgs overrides of each (async_sched: async output processing plus
# async scheduling, docs/async_scheduling.md; lora: async with every request under one of
# --max-loras random adapters of rank --max-lora-rank, throughput.bench_loras; spec: async
# with speculative decoding, --speculative-config or BENCH_SPEC, docs/speculative_decoding.md;
# quant: async on quantized weights, --quantization or a GGUF file's own blocks,
# docs/quantization.md).
_PLAIN = {"enable_lora": False, "speculative_config": None, "quantization": None}
ENGINE_MODES = {"async": {"async_scheduling": False, **_PLAIN},
                "async_sched": {"async_scheduling": True, "disable_async_output_proc": False,
                                **_PLAIN},
                "sync": {"disable_async_output_proc": True, "async_scheduling": False,
                         **_PLAIN},
                "lora": {"async_scheduling": False, **_PLAIN, "enable_lora": True},
                "spec": {"async_scheduling": False, **_PLAIN,
                         "speculative_config": BENCH_SPEC},
                "quant": {"async_scheduling": False, **_PLAIN, "quantization": "gguf"}}


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must list integers >= 1, got {text!r}")
    return values


def selected_runs(ns: argparse.Namespace) -> list[str]:
    runs = [r.strip() for r in ns.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUN_NAMES]
    if bad:
        raise ValueError(f"runs must be a subset of {RUN_NAMES}, got {bad}")
    if ns.skip_hf:
        runs = [r for r in runs if not r.startswith("hf_")]
    return runs


def _record_env(engine: Any, info: dict[str, Any]) -> None:
    """The first engine's ``env`` and ``machine`` blocks, for the JSON."""
    if not info:
        info.update(env=env_info(engine), machine=machine_info(engine))


def _engine_runs(ns: argparse.Namespace, runs: list[str], workload: Workload, bs: int,
                 prompts: list[list[int]] | None, info: dict[str, Any]
                 ) -> tuple[list[dict], list[list[int]]]:
    """async (+ floor on the same backend), async_sched and sync at one batch size."""
    out = []
    out_lens = workload.output_lens()
    for mode, overrides in needed_modes(ENGINE_MODES, runs):
        engine, skipped = build_mode_engine(ns, mode, overrides, bs, workload.num_prompts)
        if skipped is not None:
            out.append(skipped)
            continue
        try:
            if prompts is None:
                prompts = workload.prompts(vocab_size_of(engine), engine.tokenizer)
            _record_env(engine, info)
            warm_up(engine, workload, prompts, bs)
            if mode in runs:
                out.append(run_engine(engine, workload, prompts, out_lens, ns.breakdown,
                                      not ns.disable_tqdm, mode))
            if mode == "async" and "floor" in runs:
                out.append(run_floor_of(engine, workload, prompts, out_lens, bs,
                                        not ns.disable_tqdm))
        finally:
            release_engine(engine)
    return out, prompts


def _hf_runs(ns: argparse.Namespace, runs: list[str], hf_model: Any, workload: Workload,
             bs: int, prompts: list[list[int]]) -> list[dict]:
    from cadence.bench.hf_baselines import run_hf_generate, run_hf_generate_batch

    out = []
    fns = {"hf_generate": run_hf_generate, "hf_generate_batch": run_hf_generate_batch}
    for name in ("hf_generate", "hf_generate_batch"):
        if name not in runs:
            continue
        try:
            out.append(fns[name](hf_model, prompts, workload.output_lens(), bs,
                                 workload.temperature, not ns.disable_tqdm))
        except Exception as e:  # noqa: BLE001  # a baseline that cannot run here is recorded, not fatal
            out.append({"name": name, "batch_size": bs, "num_prompts": len(prompts),
                        "output_tokens_per_s": None, "skipped": f"{type(e).__name__}: {e}"})
    return out


def _check_edit_runs(runs: list[str], peer: Any) -> None:
    """--prompt-kind edit ends each answer at EOS; the floor, transformers' baselines and the
    peer run every request to its full length, so their ratios would compare other work."""
    other = [r for r in runs if r == "floor" or r.startswith("hf_")]
    if other or peer is not None:
        raise ValueError(f"--prompt-kind edit compares cadence's engine runs "
                         f"({', '.join(ENGINE_MODES)}), whose answers end at EOS; drop "
                         f"{', '.join(other) or '--peer'}")


def _check_peer_workload(runs: list[str], batch_sizes: list[int], host_works: list[str]
                         ) -> None:
    if "async" not in runs:
        raise ValueError("--peer compares the async run: keep async in --runs")
    if len(batch_sizes) > 1 or len(host_works) > 1:
        raise ValueError("--peer compares one workload: give one --batch-sizes value and one "
                         "--host-work setting per command")


def cmd_compare(ns: argparse.Namespace) -> int:
    runs = selected_runs(ns)
    peer = peer_options(ns)
    num_rounds = getattr(ns, "rounds", 1)
    if num_rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {num_rounds}")
    if num_rounds > 1 and peer is not None:
        raise ValueError("--rounds interleaves cadence's own runs; against a peer the rounds "
                         "are --peer-rounds")
    engine_runs = set(runs) & {*ENGINE_MODES, "floor"}
    if num_rounds > 1 and not engine_runs:
        raise ValueError(f"--rounds interleaves engine runs: keep at least one of "
                         f"{(*ENGINE_MODES, 'floor')} in --runs")
    if any(r.startswith("hf_") for r in runs) and not engine_runs:
        # Checked now, not after the engine runs: the baselines run last.
        raise ValueError("hf runs need an engine run to pick the prompts: add one of "
                         f"{(*ENGINE_MODES, 'floor')} to --runs")
    if getattr(ns, "prompt_kind", "random") == "edit":
        _check_edit_runs(runs, peer)
    batch_sizes = parse_int_list(ns.batch_sizes or str(min(ns.num_prompts, ns.max_num_seqs)),
                                 "batch_sizes")
    host_works = [h.strip() for h in ns.host_work.split(",")]
    peer_version, peer_section = None, None
    if peer is not None:
        _check_peer_workload(runs, batch_sizes, host_works)
        with PeerWorkdir() as workdir:
            peer_version = check_peer(peer, workdir)
    hf_model, records, info = None, [], {}
    cells: list[tuple[str, int, Workload, list[list[int]] | None, list[dict]]] = []
    started = time.perf_counter()
    try:
        for hw in host_works:
            for bs in batch_sizes:
                workload = workload_from_args(ns, bs * ns.waves if ns.waves else None, hw)
                if peer is None and num_rounds > 1:
                    recs, prompts = interleaved_runs(
                        ns, runs, ENGINE_MODES, workload, bs, num_rounds,
                        lambda engine: _record_env(engine, info))
                elif peer is None:
                    recs, prompts = _engine_runs(ns, runs, workload, bs, None, info)
                else:
                    prompts = workload_tokens(ns, workload)[0]
                    recs, _ = _engine_runs(ns, [r for r in runs if r != "async"], workload,
                                           bs, prompts, info)
                    rounds, peer_section = async_rounds_with_peer(
                        ns, peer, peer_version, workload, bs, prompts, _model_dir(ns),
                        lambda engine: _record_env(engine, info))
                    recs = rounds + recs
                cells.append((hw, bs, workload, prompts, recs))
        # The transformers baselines load torch and run its thread pool in this process,
        # which is the engine process: they run after every engine run, so none of those
        # measures an engine process with torch in it (cadence.cpuinfo.torch_facts).
        for hw, bs, workload, prompts, recs in cells:
            if any(r.startswith("hf_") for r in runs):
                if prompts is None:
                    raise ValueError("hf runs need an engine run to pick the prompts")
                if hf_model is None:
                    from cadence.bench.hf_baselines import load_hf_model

                    hf_model = load_hf_model(_model_dir(ns),
                                             info.get("env", {}).get("dtype", "float32"))
                recs += _hf_runs(ns, runs, hf_model, workload, bs, prompts)
            for r in recs:
                r.setdefault("host_work", hw)
            if num_rounds > 1:  # each round's ratios are its own
                for rnd in range(num_rounds):  # baselines ran on round 0's prompts
                    _add_ratios([r for r in recs if r.get("round", 0) == rnd])
            else:
                _add_ratios(recs)
            records += recs
    finally:
        del hf_model
    _print_compare(records, ns.breakdown)
    paired = paired_summary(records) if num_rounds > 1 else []
    print_paired(paired)
    if peer_section is not None:
        print_peer(peer_section)
    env = info.get("env", {})
    data = {"runs": records, "config": config_of(ns), "env": env,
            "machine": info.get("machine") or machine_info(ns=ns),
            "elapsed_s": time.perf_counter() - started}
    if paired:
        data["paired"] = paired
    if peer_section is not None:
        data["peer"] = peer_section
    if ns.output_json:
        write_json(ns.output_json, data)
    if ns.chart:
        draw_chart(median_records(records) if num_rounds > 1 else records, ns.chart,
                   f"cadence bench compare ({env.get('dtype')}, "
                   f"{ns.input_len} in / {ns.output_len} out)")
    return 0


def _model_dir(ns: argparse.Namespace) -> str:
    from cadence.engine_args import EngineArgs

    return EngineArgs.from_cli_args(ns)[0].resolve_model()


def _add_ratios(recs: list[dict]) -> None:
    floor = next((r for r in recs if r["name"] == "floor"), None)
    sync = next((r for r in recs if r["name"] == "sync"), None)
    for r in recs:
        tps = r.get("output_tokens_per_s")
        r["ratio_to_floor"] = tps / floor["output_tokens_per_s"] if floor and tps else None
        if r["name"] in ("async", "async_sched") and sync and tps:
            r["ratio_to_sync"] = tps / sync["output_tokens_per_s"]
        if r["name"] in ("async_sched", "lora", "spec", "quant") and tps and (a := next(
                (x for x in recs if x["name"] == "async"), None)) and a["output_tokens_per_s"]:
            r["ratio_to_async"] = tps / a["output_tokens_per_s"]
        b = r.get("breakdown")
        if b and floor:
            b["floor_device_s"] = floor["device_s"]
            b["device_slowdown_vs_floor"] = b["device_s"] / floor["device_s"]


def _print_compare(records: list[dict], breakdown: bool) -> None:
    cols = ["name", "host_work", "batch_size", "num_prompts", "output_tokens_per_s",
            "requests_per_s", "elapsed_s", "ratio_to_floor"]
    heads = ["run", "host work", "batch", "prompts", "output tok/s", "req/s", "elapsed s",
             "x floor"]
    if any("round" in r for r in records):
        cols.insert(1, "round")
        heads.insert(1, "round")
    print()
    print(format_table(records, cols, heads))
    for r in records:
        if r.get("skipped"):
            print(f"{r['name']} (batch {r['batch_size']}) skipped: {r['skipped']}")
        if breakdown:
            print_breakdown(r)


def cmd_scale(ns: argparse.Namespace) -> int:
    """Host cost per decode step with ``--num-queued`` requests waiting behind the batch."""
    queued = parse_int_list(ns.num_queued, "num_queued")
    results, info = [], {}
    for n in queued:
        engine = build_engine(ns, max_num_seqs=ns.batch_size)
        try:
            _record_env(engine, info)
            results.append(_scale_one(engine, ns, n))
        finally:
            release_engine(engine)
    phases = ["schedule", "prepare", "commit", "post_sample", "drain", "host", "execute"]
    rows = [{"phase": p, **{f"q{r['num_queued']}": r["per_step_ms"][p] for r in results}}
            for p in phases]
    cols = [f"q{r['num_queued']}" for r in results]
    print(f"\nhost cost per decode step, ms (batch {ns.batch_size}, {ns.num_steps} steps; "
          "host = schedule + prepare + commit + post_sample + drain):")
    print(format_table(rows, ["phase", *cols],
                       ["phase", *(f"{r['num_queued']} queued" for r in results)]))
    if ns.output_json:
        write_json(ns.output_json, {"scale": results, "config": config_of(ns), **info})
    return 0


def _scale_one(engine: Any, ns: argparse.Namespace, num_queued: int) -> dict[str, Any]:
    import random

    from cadence.sampling_params import SamplingParams

    bs, vocab = ns.batch_size, vocab_size_of(engine)
    budget = engine.config.scheduler_config.max_num_batched_tokens
    warmup = -(-bs * ns.input_len // budget) + 1
    params = SamplingParams(temperature=1.0, max_tokens=warmup + ns.num_steps + 2,
                            ignore_eos=True)
    rng = random.Random(ns.seed)
    t = time.perf_counter()
    for i in range(bs + num_queued):
        ids = [rng.randrange(vocab) for _ in range(ns.input_len)]
        engine.add_request(f"scale-{i}", {"prompt_token_ids": ids}, params)
    add_s = time.perf_counter() - t
    for _ in range(warmup):
        engine.step()
    before = dict(engine.stats.times.phases)
    steps0 = engine.stats.num_steps
    for _ in range(ns.num_steps):
        engine.step()
    steps = max(1, engine.stats.num_steps - steps0)
    delta = {k: v - before[k] for k, v in engine.stats.times.phases.items()}
    per_step = {k: 1000 * v / steps for k, v in delta.items()}
    per_step["host"] = sum(per_step[k] for k in
                           ("schedule", "prepare", "commit", "post_sample", "drain"))
    return {"num_queued": num_queued, "num_waiting": engine.scheduler.num_waiting,
            "num_running": engine.scheduler.num_running, "num_steps": steps,
            "add_request_ms_each": 1000 * add_s / (bs + num_queued), "per_step_ms": per_step}
