"""N ``AsyncLLM`` replicas behind the same calls as one (what the server uses)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from cadence.async_engine import AsyncLLM, EngineDeadError
from cadence.async_stream import RequestStream
from cadence.config import EngineConfig
from cadence.engine_args import EngineArgs
from cadence.metrics import EngineStats
from cadence.output_state import OutputKind
from cadence.pooling import PoolingParams
from cadence.request_front import RequestFront, request_ids
from cadence.sampling_params import SamplingParams


def pick_replica(loads: Sequence[int | None], turn: int) -> int | None:
    """The index of the least-loaded replica (None entries cannot serve); ties go round
    robin from ``turn``, so an idle server spreads its first requests. None if none can."""
    n = len(loads)
    best = None
    for k in range(n):
        i = (turn + k) % n
        if loads[i] is not None and (best is None or loads[i] < loads[best]):
            best = i
    return best


class DataParallelAsyncLLM(RequestFront):
    """Replicas of one model, each an ``AsyncLLM`` with its own engine and backend.

    A request goes to the replica with the fewest requests in flight (a replica that is
    not running is skipped), and stays there: its stream, abort and outputs are that
    replica's. Request ids are unique across the replicas. ``max_pending_requests`` bounds
    each replica, so ``EngineOverloadedError`` means every replica is full.
    """

    def __init__(self, replicas: Sequence[AsyncLLM]) -> None:
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        # The replicas share a model: its tokenizer, limits and defaults speak for all.
        self.engine = first.engine
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.generation_defaults = first.generation_defaults
        self.eos_token_ids = first.eos_token_ids
        self._turn = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, extra: dict | None = None, size: int = 2,
                         max_pending_requests: int | None = None) -> DataParallelAsyncLLM:
        """``size`` replicas of the engine ``args`` describe, started side by side."""
        from cadence.plugins import get_registry

        config = args.create_engine_config(extra)
        registry = get_registry()
        backend_cls, _ = registry.select(config.backend)
        if size > 1 and not backend_cls.supports_data_parallel:
            capable = sorted(n for n, info in registry.backends.items()
                             if info.cls.supports_data_parallel)
            raise ValueError(
                f"--data-parallel-size {size}: backend {config.backend!r} cannot serve "
                f"replicas side by side; backends that can: {', '.join(capable) or 'none'}")
        configs = replica_configs(config, size)
        from cadence.tokenizer_loader import load_tokenizer

        # Loaded here, one after another: transformers' first import is not thread-safe
        # (two replicas importing its tokenizer classes at once failed with an ImportError
        # in a fresh process), and each replica keeps a tokenizer of its own, used by its
        # engine thread only.
        tokenizers = [load_tokenizer(c.model_config.tokenizer or c.model_config.model)
                      for c in configs]
        return cls([AsyncLLM(e, max_pending_requests)
                    for e in start_replicas(configs, tokenizers)])

    # ---- the AsyncLLM calls ----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def num_pending_requests(self) -> int:
        return sum(r.num_pending_requests for r in self.replicas)

    def check_health(self) -> str | None:
        """None while some replica can serve (requests are routed around the others)."""
        problems = self.replica_problems()
        if all(p is not None for p in problems):
            return "no replica can serve: " + "; ".join(
                f"replica {i}: {p}" for i, p in enumerate(problems))
        return None

    @property
    def max_pending_requests(self) -> int | None:
        """The most requests the replicas take at once, together (None: no bound)."""
        limits = [r.max_pending_requests for r in self.replicas]
        return None if any(x is None for x in limits) else sum(limits)

    def replica_problems(self) -> list[str | None]:
        """Each replica's ``check_health()``, by rank."""
        return [r.check_health() for r in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' stats summed (gauges too; KV cache usage averaged)."""
        return EngineStats.merged(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's latest stats snapshot, by rank."""
        return [r.stats() for r in self.replicas]

    async def add_request(self, prompt: str | Sequence[int] | dict,
                          params: SamplingParams | PoolingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          output_kind: OutputKind | None = None,
                          lora_request: Any = None) -> RequestStream:
        """``AsyncLLM.add_request`` on the least-loaded replica."""
        if request_id is not None and any(r.has_request(request_id) for r in self.replicas):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # A replica that is restarting its worker (or whose worker just died) has nothing
        # in flight, so the least-loaded rule would favour it; it is passed over while
        # another can serve, as /health reports it degraded.
        turn = next(self._turn)
        running = [r.num_pending_requests if r.is_running else None for r in self.replicas]
        healthy = [n if n is not None and r.check_health() is None else None
                   for n, r in zip(running, self.replicas)]
        i = pick_replica(healthy, turn)
        if i is None:
            i = pick_replica(running, turn)  # none healthy: wait where it will run
        if i is None:
            raise EngineDeadError("no replica is running")
        # No await between the id check and the replica registering the id: another
        # request with the same id cannot slip in between.
        return await self.replicas[i].add_request(prompt, params, request_id, priority,
                                                  output_kind, lora_request)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in request_ids(request_id):
            for r in self.replicas:
                if r.has_request(rid):
                    await r.abort(rid)

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))


def start_replicas(configs: Sequence[EngineConfig], tokenizers: Sequence[Any] | None = None
                   ) -> list[Any]:
    """An ``LLMEngine`` per config, started side by side: each replica's model load (a
    worker process on the CPU) runs while the others load. If one fails, the others are
    shut down and its error raised. On Ctrl-C the interrupt is raised at once, not after
    minutes of loading: the replicas already built are shut down now, and those still
    loading shut themselves down when they are built (their threads are daemons, so an
    exiting process does not wait for them; their workers leave with it). ``tokenizers``:
    each replica's, loaded beforehand (None: each engine loads its own in its thread)."""
    from cadence.engine import LLMEngine

    results: list[Any] = [None] * len(configs)
    lock = threading.Lock()
    abandoned = False

    def start(i: int, config: EngineConfig) -> None:
        try:
            engine = LLMEngine(config) if tokenizers is None else \
                LLMEngine(config, tokenizers[i])
        except BaseException as e:  # noqa: BLE001  # raised by the caller below
            results[i] = e
            return
        with lock:
            keep = not abandoned
            if keep:
                results[i] = engine
        if not keep:
            engine.shutdown()

    threads = [threading.Thread(target=start, args=(i, c), daemon=True,
                                name=f"cadence-replica{i}-start")
               for i, c in enumerate(configs)]
    for t in threads:
        t.start()
    try:
        wait_all(threads)
    except BaseException:
        with lock:
            abandoned = True
            built = [r for r in results if isinstance(r, LLMEngine)]
        for engine in built:
            engine.shutdown()
        raise
    engines = [r for r in results if isinstance(r, LLMEngine)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for engine in engines:
            engine.shutdown()
        raise errors[0]
    return engines


def wait_all(threads: Sequence[threading.Thread]) -> None:
    for t in threads:
        t.join()


def replica_configs(config: EngineConfig, size: int) -> list[EngineConfig]:
    """``config`` for each of ``size`` replicas (its rank in ``parallel_config``)."""
    return [dataclasses.replace(config, parallel_config=dataclasses.replace(
        config.parallel_config, data_parallel_size=size, data_parallel_rank=rank))
            for rank in range(size)]

