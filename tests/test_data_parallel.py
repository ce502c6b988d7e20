"""Data-parallel serving: replicas behind one front (core/data_parallel/), each CPU replica's
worker on its own cores, requests to the least loaded, per-replica metrics and health."""

from __future__ import annotations

import asyncio
import os
from typing import ClassVar

import pytest
from engine_helpers import make_llm

from cadence import SamplingParams
from cadence.backends.cpu.placement import replica_cpus
from cadence.config import ParallelConfig
from cadence.data_parallel import DataParallelAsyncLLM, pick_replica
from cadence.engine_args import EngineArgs
from cadence.metrics import EngineStats

PROMPTS = ["the cat sat on", "a b c d e", "one two three", "why is the sky", "hello there",
           "9 8 7 6", "x y", "the end of the"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_the_least_loaded_replica_gets_the_request_ties_in_turn():
    assert pick_replica([3, 1, 1], 0) == 1
    assert pick_replica([3, 1, 1], 2) == 2  # a tie starts from the turn
    assert [pick_replica([0, 0, 0], t) for t in range(4)] == [0, 1, 2, 0]
    assert pick_replica([None, 5], 0) == 1  # a replica that is not running is skipped
    assert pick_replica([None, None], 0) is None


def test_each_replica_takes_its_own_share_of_the_cores():
    eight = list(range(8))
    shares = [replica_cpus(ParallelConfig(3, r), eight) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [replica_cpus(ParallelConfig(2, r), [4, 9]) for r in range(2)] == [[4], [9]]
    assert replica_cpus(ParallelConfig(1, 0), eight) is None  # a lone engine keeps them all
    with pytest.raises(ValueError, match="needs at least 3 CPU cores"):
        replica_cpus(ParallelConfig(3, 0), [0, 1])
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        ParallelConfig(2, 2)


def test_stats_of_replicas_merge():
    a, b = EngineStats(), EngineStats()
    a.num_generation_tokens, b.num_generation_tokens = 5, 7
    a.finish_reasons, b.finish_reasons = {"stop": 1}, {"stop": 2, "length": 1}
    a.kv_cache_usage, b.kv_cache_usage = 0.2, 0.4
    a.time_to_first_token.observe(0.01)
    b.time_to_first_token.observe(5.0)
    m = EngineStats.merged([a, b])
    assert m.num_generation_tokens == 12 and m.finish_reasons == {"stop": 3, "length": 1}
    assert m.kv_cache_usage == pytest.approx(0.3)
    assert m.time_to_first_token.count == 2 and m.time_to_first_token.total == pytest.approx(5.01)
    assert sum(m.time_to_first_token.counts) == 2


def _args(model: str, **kw) -> EngineArgs:
    kw.setdefault("backend_options", {"overlap": "process", "kv_cache_gb": 0.1})
    return EngineArgs(model=model, max_model_len=256, **kw)


needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two replicas need two CPU cores")


@needs_two_cores
def test_replicas_start_in_a_process_that_never_imported_transformers(tiny_model_dir):
    """The replicas start side by side in threads; transformers' first import is not
    thread-safe, so two of them loading a tokenizer at once failed in a fresh process
    (this test process has imported it long ago: a fresh one is needed)."""
    import subprocess
    import sys

    code = ("import asyncio, sys; from cadence import EngineArgs; "
            "from cadence.data_parallel import DataParallelAsyncLLM; "
            "assert 'transformers' not in sys.modules; "
            "dp = DataParallelAsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], "
            "max_model_len=64, backend_options={'overlap': 'process', 'kv_cache_gb': 0.05})"
            ", size=2); asyncio.run(dp.shutdown()); print('started')")
    out = subprocess.run([sys.executable, "-c", code, tiny_model_dir("llama")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "started" in out.stdout, out.stderr[-2000:]


@needs_two_cores
def test_two_replicas_serve_bound_to_their_cores_and_route_by_load(tiny_model_dir):
    model = tiny_model_dir("llama")
    reference = [o.outputs[0].token_ids for o in
                 make_llm(model).generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def main():
        dp = DataParallelAsyncLLM.from_engine_args(_args(model), size=2)
        try:
            pids = [r.engine.backend.worker_pid for r in dp.replicas]
            cores = [os.sched_getaffinity(pid) for pid in pids]
            assert not cores[0] & cores[1], cores  # no core shared
            assert cores[0] | cores[1] == set(os.sched_getaffinity(0))

            async def one(i: int, prompt: str) -> list[int]:
                tokens: list[int] = []
                async for out in dp.generate(prompt, GREEDY, request_id=f"r{i}"):
                    tokens = list(out.outputs[0].token_ids)  # everything so far
                return tokens

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            per_replica = [s.num_requests_added for s in dp.replica_stats()]
            assert sorted(per_replica) == [4, 4], per_replica  # spread by load
            assert dp.stats().num_requests_added == len(PROMPTS)
            return got
        finally:
            await dp.shutdown()

    got = asyncio.run(main())
    # Each replica computes with one thread: the same tokens as the whole machine.
    assert got == reference


@needs_two_cores
def test_ids_aborts_metrics_and_health_across_replicas(tiny_model_dir):
    httpx = pytest.importorskip("httpx")
    from prometheus_client.parser import text_string_to_metric_families

    from cadence.server.app import build_app

    model = tiny_model_dir("llama")
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        dp = DataParallelAsyncLLM.from_engine_args(_args(model), size=2)
        try:
            stream = await dp.add_request("a long one", long, request_id="same")
            with pytest.raises(ValueError, match="already in use"):
                # The other replica is idler, and still refuses the id.
                await dp.add_request("another", GREEDY, request_id="same")
            await dp.abort("same")
            outs = [o async for o in stream]
            assert outs[-1].outputs[0].finish_reason == "abort"
            app = build_app(dp, "tiny")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test") as client:
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200, r.text
                # Embeddings route by load too: four inputs, spread over both replicas.
                before = [s.num_requests_added for s in dp.replica_stats()]
                r = await client.post("/v1/embeddings", json={"input": ["a", "b c", "d", "e"]})
                assert r.status_code == 200, r.text
                assert [d["index"] for d in r.json()["data"]] == [0, 1, 2, 3]
                after = [s.num_requests_added for s in dp.replica_stats()]
                assert all(a > b for a, b in zip(after, before)), (before, after)
                text = (await client.get("/metrics")).text
                running = [s for f in text_string_to_metric_families(text)
                           if f.name == "vllm:num_requests_running" for s in f.samples]
                assert sorted(s.labels["engine"] for s in running) == ["0", "1"]
                assert (await client.get("/health")).json() == {"status": "ok"}
                # A replica restarting its worker is passed over while the other serves.
                restarting = dp.replicas[0]
                restarting.check_health = lambda: "the engine is restarting its worker"
                before = [s.num_requests_added for s in dp.replica_stats()]
                for _ in range(3):
                    r = await client.post("/v1/completions",
                                          json={"prompt": "y", "max_tokens": 2})
                    assert r.status_code == 200, r.text
                after = [s.num_requests_added for s in dp.replica_stats()]
                assert (after[0] - before[0], after[1] - before[1]) == (0, 3)
                del restarting.check_health
                await dp.replicas[1].shutdown()  # one replica down: the other serves
                health = (await client.get("/health")).json()
                assert health["status"] == "degraded" and health["replicas"][0]["status"] == "ok"
                for _ in range(3):
                    r = await client.post("/v1/completions",
                                          json={"prompt": "y", "max_tokens": 2})
                    assert r.status_code == 200, r.text
                await dp.replicas[0].shutdown()
                r = await client.get("/health")
                assert r.status_code == 503 and "no replica can serve" in r.text
        finally:
            await dp.shutdown()

    asyncio.run(main())


def test_refusals_name_what_would_work(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="needs the 'process' overlap strategy"):
        DataParallelAsyncLLM.from_engine_args(
            _args(model, backend_options={"overlap": "sync"}), size=2)
    from cadence.backends.cpu import placement

    monkeypatch.setattr(placement, "available_cpus", lambda: [0])
    with pytest.raises(ValueError, match="needs at least 2 CPU cores"):
        DataParallelAsyncLLM.from_engine_args(_args(model), size=2)
    with pytest.raises(ValueError, match=r"backend 'example' cannot serve replicas side by "
                                         r"side; backends that can: cpu"):
        DataParallelAsyncLLM.from_engine_args(_args(model, backend="example",
                                                    backend_options={}), size=2)


def test_serve_flag_builds_the_replicas(monkeypatch):
    import types

    import cadence.cli.serve
    from cadence.cli import main as cli

    built = []
    fake = types.SimpleNamespace(tokenizer=None, max_model_len=256, generation_defaults=())
    monkeypatch.setattr(DataParallelAsyncLLM, "from_engine_args", classmethod(
        lambda cls, args, extra, size, max_pending_requests: built.append(
            (size, max_pending_requests)) or fake))
    messages = []
    monkeypatch.setattr(cadence.cli.serve, "serve_app",
                        lambda app, sock, msg, **kw: messages.append(msg))
    base = ["serve", "--served-model-name", "tiny", "--log-level", "warning", "--port", "0",
            "--max-num-seqs", "8"]
    assert cli.main(base + ["--data-parallel-size", "3"]) == 0
    assert built == [(3, 32)] and "3 replicas" in messages[0]
    assert cli.main(base + ["--data-parallel-size", "0"]) == 2



class _FakeEngine:
    """Stands in for ``LLMEngine`` in start-up tests: replica 1 loads until released, and
    replica 2 fails to start."""

    release = None
    built: ClassVar[list] = []

    def __init__(self, config) -> None:
        rank = config.parallel_config.data_parallel_rank
        if rank == 1:
            assert self.release.wait(10), "never released"
        if rank == 2:
            raise ValueError("replica 2 cannot start")
        self.rank, self.shut = rank, False
        _FakeEngine.built.append(self)

    def shutdown(self) -> None:
        self.shut = True


def _start(monkeypatch, size: int, interrupt: bool):
    """``start_replicas`` on fake engines; with ``interrupt``, Ctrl-C lands while replica 1
    still loads."""
    import threading
    import types

    import cadence.engine
    from cadence.data_parallel import replicas

    _FakeEngine.release, _FakeEngine.built = threading.Event(), []
    monkeypatch.setattr(cadence.engine, "LLMEngine", _FakeEngine)

    def wait_all(threads):
        if interrupt:
            while not _FakeEngine.built:  # replica 0 is up
                threading.Event().wait(0.01)
            raise KeyboardInterrupt
        _FakeEngine.release.set()
        for t in threads:
            t.join()

    monkeypatch.setattr(replicas, "wait_all", wait_all)
    configs = [types.SimpleNamespace(parallel_config=ParallelConfig(size, r))
               for r in range(size)]
    return replicas.start_replicas(configs)


def _state() -> list:
    return sorted((e.rank, e.shut) for e in _FakeEngine.built)


def test_ctrl_c_during_start_shuts_down_every_replica_without_waiting(monkeypatch):
    """The interrupt is raised while a replica still loads: the one already built is shut
    down at once, and the one still loading shuts itself down once it is built."""
    import time

    with pytest.raises(KeyboardInterrupt):
        _start(monkeypatch, 2, interrupt=True)
    assert _state() == [(0, True)]
    _FakeEngine.release.set()
    deadline = time.monotonic() + 5
    while _state() != [(0, True), (1, True)] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state() == [(0, True), (1, True)]


def test_a_replica_that_fails_to_start_stops_the_others(monkeypatch):
    with pytest.raises(ValueError, match="replica 2 cannot start"):
        _start(monkeypatch, 3, interrupt=False)
    assert _state() == [(0, True), (1, True)]
