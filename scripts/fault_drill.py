"""Fault drill: kill or freeze the CPU forward worker under concurrent streams and time what
follows (every stream's error, the restart, the first request served again).

    python scripts/fault_drill.py [--model DIR] [--streams 40] [--fault kill|freeze]
                                  [--step-timeout 5]

Prints one JSON object; docs/reliability.md quotes its figures. Without --model it runs the
built-in default model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

from cadence import OutputKind, SamplingParams
from cadence.async_engine import AsyncLLM, RequestFailedError
from cadence.cpuinfo import describe
from cadence.engine_args import EngineArgs


async def _stream(engine: AsyncLLM, prompt: str, params: SamplingParams) -> float | str:
    try:
        # Deltas: the drill's timings stay those of a streaming server.
        async for _ in engine.generate(prompt, params, output_kind=OutputKind.DELTA):
            pass
    except RequestFailedError:
        return time.monotonic()
    return "finished"


async def drill(ns: argparse.Namespace) -> dict:
    args = EngineArgs(model=ns.model, step_timeout=ns.step_timeout, backend="cpu",
                      backend_options={"overlap": "process", "kv_cache_gb": 0.5})
    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(args)
    start_s = time.monotonic() - t0
    t1 = time.monotonic()
    async for _ in engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0)):
        pass
    first_request_s = time.monotonic() - t1
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    prompts = [f"Request {i}: write a long story about the sea." for i in range(ns.streams)]
    tasks = [asyncio.ensure_future(_stream(engine, p, params)) for p in prompts]
    while engine.stats().num_generation_tokens < 4 * ns.streams:
        await asyncio.sleep(0.01)
    pid = engine.engine.backend.worker_pid
    t_fault = time.monotonic()
    os.kill(pid, signal.SIGKILL if ns.fault == "kill" else signal.SIGSTOP)
    health_503 = None
    while health_503 is None:
        if engine.check_health() is not None:
            health_503 = time.monotonic() - t_fault
        await asyncio.sleep(0.001)
    ends = await asyncio.gather(*tasks)
    failed = [t for t in ends if isinstance(t, float)]
    while engine.check_health() is not None:
        await asyncio.sleep(0.01)
    t_healthy = time.monotonic() - t_fault
    t1 = time.monotonic()
    async for _ in engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0)):
        pass
    first_request_again_s = time.monotonic() - t1
    stats = engine.stats()
    await engine.shutdown()
    return {
        "machine": describe(dtype=engine.engine.config.model_config.dtype), "model": args.resolve_model(), "fault": ns.fault,
        "streams": ns.streams, "step_timeout": ns.step_timeout, "engine_start_s": start_s,
        "health_503_after_s": health_503,
        "streams_failed": len(failed),
        "last_stream_error_after_s": max(failed) - t_fault if failed else None,
        "healthy_again_after_s": t_healthy, "first_request_after_start_s": first_request_s,
        "first_request_after_restart_s": first_request_again_s,
        "finish_reasons": stats.finish_reasons,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--fault", choices=("kill", "freeze"), default="kill")
    p.add_argument("--step-timeout", type=float, default=5.0)
    ns = p.parse_args()
    print(json.dumps(asyncio.run(drill(ns)), indent=1, default=str))


if __name__ == "__main__":
    main()
