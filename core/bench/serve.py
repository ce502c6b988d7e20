"""``engine bench serve``: throughput and latency through the HTTP server, in the idiom of
vLLM's benchmark_serving.py, next to the offline engine on the same workload.

The server runs as its own process (``engine serve`` with the same engine flags), as a user
would run it, so the client's work does not share the server's interpreter; or pass
``--base-url`` to measure any running OpenAI-compatible server (cadence's or another's).
Requests stream from ``/v1/completions`` with token-id prompts and ``ignore_eos``, so every
server generates exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from cadence.bench.report import env_info, format_table, machine_info, write_json
from cadence.bench.throughput import (
    HEAVY_LOGPROBS,
    HEAVY_STOP,
    Workload,
    build_engine,
    config_of,
    release_engine,
    run_engine,
    workload_from_args,
    workload_tokens,
)


def cmd_serve_bench(ns: argparse.Namespace) -> int:
    workload = workload_from_args(ns)
    if workload.prompt_kind != "random":
        raise ValueError("engine bench serve sends random prompts of --input-len that run to "
                         "--output-len; --prompt-kind edit is for bench compare and throughput")
    prompts, out_lens = workload_tokens(ns, workload)
    server = None
    base = ns.base_url
    if base is None:
        server, base = _start_server(ns, len(prompts))
    try:
        rec = asyncio.run(_drive(base.rstrip("/"), prompts, out_lens, workload,
                                 ns.request_rate, ns.seed, not ns.disable_tqdm))
    finally:
        if server is not None:
            _stop(server)
    records = [rec]
    env, machine = None, None
    if ns.compare_offline:
        engine = build_engine(ns)
        try:
            off = run_engine(engine, workload, prompts, out_lens, progress=not ns.disable_tqdm,
                             name="offline")
            env, machine = env_info(engine), machine_info(engine)
        finally:
            release_engine(engine)
        records.append(off)
        rec["ratio_to_offline"] = rec["output_tokens_per_s"] / off["output_tokens_per_s"]
    cols = ["name", "num_prompts", "num_output_tokens", "elapsed_s", "output_tokens_per_s",
            "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "itl_p99_ms", "ratio_to_offline"]
    print(format_table(records, cols))
    if ns.output_json:
        # Without an offline engine here, the machine block is this process's view (the
        # server started with the same flags and environment).
        write_json(ns.output_json, {"runs": records, "config": config_of(ns, workload),
                                    "env": env, "machine": machine or machine_info(ns=ns)})
    return 0


# ---- the server process -----------------------------------------------------------------
def engine_flags(ns: argparse.Namespace) -> list[str]:
    """The engine (and plugin) flags of ``ns`` that differ from their defaults, as argv."""
    from cadence.engine_args import EngineArgs

    parser = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _start_server(ns: argparse.Namespace, num_prompts: int) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="cadence-serve-", suffix=".log",
                                      delete=False)
    cmd = [sys.executable, "-m", "cadence.cli.main", "serve", *engine_flags(ns),
           "--port", str(port), "--log-level", "warning",
           "--max-pending-requests", str(max(num_prompts, 1))]
    print(f"starting: {' '.join(cmd)} (log: {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ns.server_start_timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"engine serve exited with {proc.returncode}:\n"
                               f"{log.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"engine serve did not start in {ns.server_start_timeout} s")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the client -------------------------------------------------------------------------
async def _drive(base: str, prompts: list[list[int]], out_lens: list[int], workload: Workload,
                 rate: float, seed: int, progress: bool) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="serve", dynamic_ncols=True)

        async def one(delay: float, ids: list[int], n: int) -> dict[str, Any]:
            await asyncio.sleep(delay)
            res = await _request(client, model, ids, n, workload)
            if bar is not None:
                bar.update(1)
            return res

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate != float("inf"):
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(d, p, n) for d, p, n in
                                         zip(delays, prompts, out_lens)))
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return _summary(results, elapsed, sum(map(len, prompts)), rate)


async def _request(client: Any, model: str, ids: list[int], n: int, workload: Workload
                   ) -> dict[str, Any]:
    heavy = workload.host_work == "heavy"
    body = {"model": model, "prompt": ids, "max_tokens": n, "ignore_eos": True,
            "temperature": workload.temperature, "top_p": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if heavy:
        body.update(stop=HEAVY_STOP, logprobs=HEAVY_LOGPROBS)
    sent = time.perf_counter()
    arrivals: list[float] = []
    num_out = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_out = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk["choices"]):
                arrivals.append(time.perf_counter())
    done = time.perf_counter()
    return {"sent": sent, "arrivals": arrivals, "done": done, "num_out": num_out}


def _summary(results: list[dict], elapsed: float, num_in: int, rate: float) -> dict[str, Any]:
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    # First to last chunk with text, as vLLM times it (not the stream's closing).
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["num_out"] - 1)
            for r in results if r["arrivals"] and r["num_out"] > 1]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    num_out = sum(r["num_out"] for r in results)

    def ms(values: list[float], q: float) -> float | None:
        if not values:
            return None
        if q == 0.5:
            return 1000 * statistics.median(values)
        # Nearest rank: the smallest value with at least q of them at or below it.
        values = sorted(values)
        return 1000 * values[max(0, math.ceil(q * len(values)) - 1)]

    return {
        "name": "serve", "num_prompts": len(results), "num_input_tokens": num_in,
        "num_output_tokens": num_out, "elapsed_s": elapsed,
        "request_rate": None if rate == float("inf") else rate,
        "requests_per_s": len(results) / elapsed, "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "ttft_mean_ms": 1000 * statistics.fmean(ttft) if ttft else None,
        "ttft_median_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99),
        "tpot_median_ms": ms(tpot, 0.5), "tpot_p99_ms": ms(tpot, 0.99),
        "itl_median_ms": ms(itl, 0.5), "itl_p99_ms": ms(itl, 0.99),
    }
