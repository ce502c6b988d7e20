"""``engine bench embed``: embedding throughput (prompt tokens per second) of cadence's
``embed``, in rounds alternated with transformers' forward on the same prompts and, with
``--peer vllm``, vLLM's pooling runner; each round's vectors are checked against
transformers' before any figure is reported."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from cadence.bench.report import env_info, machine_info, write_json
from cadence.bench.throughput import (
    build_engine,
    release_engine,
    vocab_size_of,
    warmup_prompt,
    workload_from_args,
)


def run_cadence(engine: Any, prompts: list[list[int]], params: Any) -> tuple[dict, list]:
    from cadence.output_state import OutputKind

    engine.reset_prefix_cache()  # the same prompts every round: no round may hit the cache
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"embed-{i}", {"prompt_token_ids": ids}, params,
                           output_kind=OutputKind.FINAL_ONLY)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    vectors = [done[f"embed-{i}"].outputs.embedding for i in range(len(prompts))]
    return _record("cadence", prompts, elapsed), vectors


def run_hf(model: Any, prompts: list[list[int]], batch_size: int, pooling: str,
           normalize: bool) -> tuple[dict, Any]:
    """transformers' base model on batches of ``batch_size`` equal-length prompts (no
    padding), pooled and normalized as cadence pools."""
    import torch

    outs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for g in range(0, len(prompts), batch_size):
            h = model(torch.tensor(prompts[g:g + batch_size])).last_hidden_state.float()
            v = {"last": h[:, -1], "mean": h.mean(1), "cls": h[:, 0]}[pooling]
            outs.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    elapsed = time.perf_counter() - start
    return _record("hf", prompts, elapsed), torch.cat(outs)


def _record(name: str, prompts: list[list[int]], elapsed: float) -> dict[str, Any]:
    n = sum(map(len, prompts))
    return {"engine": name, "prompt_tokens": n, "elapsed_s": elapsed,
            "prompt_tokens_per_s": n / elapsed}


def _worst(vectors: Any, ref: Any) -> float:
    import torch

    return (torch.tensor(vectors, dtype=torch.float32) - ref.float()).abs().max().item()


def cmd_embed(ns: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModel

    from cadence.bench.peer import PeerWorkdir, check_peer, peer_options, run_peer
    from cadence.pooling import PoolingParams

    workload = workload_from_args(ns)
    ns.peer_rounds = ns.rounds
    opts = peer_options(ns)
    engine = build_engine(ns)
    records: list[dict[str, Any]] = []
    try:
        prompts = workload.prompts(vocab_size_of(engine), engine.tokenizer)
        cfg = engine.config.model_config
        pooler, dtype = cfg.pooler_config, cfg.dtype
        params = PoolingParams()
        hf = AutoModel.from_pretrained(cfg.model, dtype=getattr(torch, dtype)).eval()
        run_cadence(engine, [warmup_prompt(p) for p in prompts[:8]], params)
        run_hf(hf, [warmup_prompt(p) for p in prompts[:8]], ns.hf_batch_size,
               pooler.pooling_type, pooler.normalize)
        with PeerWorkdir() as workdir:
            version = None
            if opts is not None:
                version = check_peer(opts, workdir)
                _write_work(workdir / "embed.json", prompts, ns.tokenizer)
            for rnd in range(1, ns.rounds + 1):
                rec, vectors = run_cadence(engine, prompts, params)
                hf_rec, ref = run_hf(hf, prompts, ns.hf_batch_size, pooler.pooling_type,
                                     pooler.normalize)
                rec["max_abs_diff_vs_hf"] = _worst(vectors, ref)
                records += [{**rec, "round": rnd}, {**hf_rec, "round": rnd}]
                for config in (opts.configs if opts is not None else ()):
                    res = run_peer(opts, config, rnd, workdir / "embed.json", cfg.model, dtype,
                                   workdir, task="embed")
                    res["max_abs_diff_vs_hf"] = _worst([res.pop("first_embedding")], ref[:1])
                    records.append({**res, "engine": f"vllm-{config}", "round": rnd})
                print(" | ".join(f"{r['engine']} {r['prompt_tokens_per_s']:.0f} tok/s"
                                 for r in records if r["round"] == rnd), flush=True)
        env, machine = env_info(engine), machine_info(engine)
    finally:
        release_engine(engine)
    summary = _summary(records)
    for name, s in summary.items():
        print(f"{name}: median {s['median']:.1f} prompt tokens/s over {s['rounds']} rounds "
              f"({s['vs_cadence']:.2f}x cadence's)")
    worst = max(r.get("max_abs_diff_vs_hf", 0.0) for r in records)
    print(f"largest difference from transformers' vectors: {worst:.2e}")
    if ns.output_json:
        write_json(ns.output_json, {"runs": records, "summary": summary, "dtype": dtype,
                                    "pooling": pooler.pooling_type, "peer_version": version,
                                    "workload": workload.to_dict(), "env": env,
                                    "machine": machine})
    return 0


def _write_work(path: Any, prompts: list[list[int]], tokenizer: str | None) -> None:
    import json

    path.write_text(json.dumps({"prompts": prompts, "tokenizer": tokenizer,
                                "warmup_prompt": warmup_prompt(prompts[0])}))


def _summary(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    by: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r["engine"], []).append(r["prompt_tokens_per_s"])
    base = statistics.median(by["cadence"])
    return {name: {"median": statistics.median(v), "rounds": len(v),
                   "vs_cadence": statistics.median(v) / base} for name, v in by.items()}
