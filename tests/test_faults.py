"""Faults: a step that fails on one request ends that request alone; a worker that dies or
freezes ends every request with a clear error within the deadline, frees every block, and
is restarted (or the engine says plainly that it will not); device backends classify their
errors the same way. docs/reliability.md describes the behaviour these tests pin down."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from engine_helpers import make_llm
from test_async_engine import all_blocks_free, collect, wait_until, with_engine

from cadence import SamplingParams
from cadence.async_engine import EngineDeadError, RequestFailedError
from cadence.backend import WorkerLostError, raise_if_device_lost
from cadence.engine import LLMEngine
from cadence.engine_args import EngineArgs

PROMPTS = ["the quick brown fox", "a small bird sings", "hello there", "once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WORKER = {"overlap": "process", "kv_cache_gb": 0.1}
RESTART_S = 180  # a worker restart takes ~8 s on 2 busy cores; far more only when starved


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def clean(model):
    """Each prompt's greedy tokens, run alone."""
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def _run_engine(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "two final outputs"
                finals[out.request_id] = out
    return finals


POISON_SEED = 4242  # the request with this seed (n samples: seeds 4242..4242+n-1) fails


def _poison(engine: LLMEngine, calls: list | None = None) -> None:
    """Make every step that samples the poisoned request fail, as a bug tied to it would."""
    execute = engine.backend.execute

    def failing(mi, post_sample):
        if calls is not None:
            calls.append(list(mi.request_ids))
        if any(s is not None and 0 <= s - POISON_SEED < 8 for s in mi.sampling.seeds):
            raise RuntimeError("simulated failure on the poisoned request")
        return execute(mi, post_sample)

    engine.backend.execute = failing


@pytest.mark.parametrize("async_output", [True, False])
def test_a_request_that_fails_the_step_fails_alone(model, clean, async_output):
    llm = make_llm(model, disable_async_output_proc=not async_output)
    engine = llm.engine
    calls: list = []
    _poison(engine, calls)
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    reqs["bad"] = ("a poisoned prompt", SamplingParams(max_tokens=8, n=2, seed=POISON_SEED))
    finals = _run_engine(engine, reqs)
    assert set(finals) == set(reqs)
    for i, p in enumerate(PROMPTS):
        out = finals[f"r{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == clean[p], "a healthy request changed"
    bad = finals["bad"]
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert "simulated failure on the poisoned request" in bad.error
    assert "Traceback" not in bad.error
    assert any(len(ids) == 1 for ids in calls), "the step was not split to find the culprit"
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    engine.block_manager.check_invariants()
    assert engine.stats.finish_reasons.get("error") == 2  # per sample, as vLLM counts
    # The engine goes on serving, and the same prompt without the fault is fine.
    engine.backend.execute = type(engine.backend).execute.__get__(engine.backend)
    again = _run_engine(engine, {"after": (PROMPTS[0], GREEDY)})
    assert again["after"].outputs[0].token_ids == clean[PROMPTS[0]]
    llm.shutdown()


def test_a_transient_step_failure_costs_nothing(model, clean):
    llm = make_llm(model)
    engine = llm.engine
    execute, calls = engine.backend.execute, [0]

    def once(mi, post_sample):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a one-off failure")
        return execute(mi, post_sample)

    engine.backend.execute = once
    finals = _run_engine(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert {finals[f"r{i}"].outputs[0].token_ids == clean[p]
            for i, p in enumerate(PROMPTS)} == {True}
    llm.shutdown()


def test_a_request_the_scheduler_cannot_place_fails_alone(model, clean):
    """The scheduler's last guard (a request needing more KV blocks than the cache has,
    which start-up checks make unreachable today) ends that request, not the engine."""
    from cadence.scheduler import RequestTooLargeError

    llm = make_llm(model)
    engine = llm.engine
    check = engine.scheduler._check_fits

    def check_fits(request, num_new):
        if request.request_id == "big":
            raise RequestTooLargeError(request, "request 'big' needs 99 KV blocks")
        check(request, num_new)

    engine.scheduler._check_fits = check_fits
    finals = _run_engine(engine, {"big": (PROMPTS[0], SamplingParams(max_tokens=30)),
                                  "ok": (PROMPTS[2], GREEDY)})
    assert finals["big"].outputs[0].finish_reason == "error"
    assert "KV blocks" in finals["big"].error
    assert finals["ok"].outputs[0].token_ids == clean[PROMPTS[2]]
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    llm.shutdown()


def test_an_error_in_the_worker_process_comes_back_readable(model, clean):
    """The worker's exception text reaches the request; the worker itself keeps serving."""
    llm = make_llm(model, backend_options=WORKER)
    engine = llm.engine
    # A token id past the vocabulary slips past validation only through the backend: the
    # embedding lookup fails inside the worker, for that request only.
    vocab = engine.vocab_size
    engine.vocab_size = None  # let the bad id through the door
    finals = _run_engine(engine, {"bad": ([1, vocab + 5], SamplingParams(max_tokens=3)),
                                  "ok": (PROMPTS[1], GREEDY)})
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "index" in finals["bad"].error.lower()
    assert finals["ok"].outputs[0].token_ids == clean[PROMPTS[1]]
    engine.vocab_size = vocab
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    llm.shutdown()


async def _stream_all(engine, n: int, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return await asyncio.gather(*(collect(engine, PROMPTS[i % len(PROMPTS)], params)
                                  for i in range(n)), return_exceptions=True)


def _slow_steps(engine, seconds: float = 0.02) -> None:
    """Steps of a tiny model take ~1 ms: slow them so a fault lands mid-generation."""
    execute = engine.engine.backend.execute

    def slow(mi, post_sample):
        time.sleep(seconds)
        return execute(mi, post_sample)

    engine.engine.backend.execute = slow


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_worker_lost_under_40_streams_then_restarted(model, clean, fault):
    async def body(engine):
        _slow_steps(engine)
        pid = engine.engine.backend.worker_pid
        streams = asyncio.ensure_future(_stream_all(engine, 40, 200))
        await wait_until(lambda: engine.stats().num_generation_tokens > 40)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if fault == "kill":
            await wait_until(lambda: engine.check_health() is not None, timeout=2)
        results = await streams
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, RequestFailedError) for r in results), results[:3]
        expect = "SIGKILL" if fault == "kill" else "no reply within 2 s"
        assert expect in str(results[0]) and "restarting" in str(results[0])
        assert elapsed < 2 + 10, f"errors took {elapsed:.1f} s"
        await wait_until(lambda: engine.check_health() is None, timeout=RESTART_S)
        assert engine.engine.backend.worker_pid != pid
        assert all_blocks_free(engine)
        _, ids, reasons = await collect(engine, PROMPTS[0], GREEDY)
        assert ids[0] == clean[PROMPTS[0]] and reasons[0] == "length"
        assert engine.stats().finish_reasons.get("error") == 40
        if fault == "freeze":
            assert _gone(pid), "the frozen worker was left behind"

    with_engine(model, body, backend_options=WORKER, step_timeout=2)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_worker_lost_while_idle_is_found_and_repaired(model, clean, fault):
    """Death is seen at once (the process is gone); a freeze within the idle loop's next
    ping plus the step deadline."""
    async def body(engine):
        pid = engine.engine.backend.worker_pid
        assert engine.check_health() is None
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        # kill: /health sees it itself; freeze: a ping each idle second, 2 s deadline.
        await wait_until(lambda: engine.check_health() is not None,
                         timeout=1 if fault == "kill" else 1 + 2 + 2)
        await wait_until(lambda: engine.check_health() is None, timeout=RESTART_S)
        assert engine.engine.backend.worker_pid != pid and _gone(pid)
        _, ids, _ = await collect(engine, PROMPTS[3], GREEDY)
        assert ids[0] == clean[PROMPTS[3]]

    with_engine(model, body, backend_options=WORKER, step_timeout=2)


def test_no_restart_budget_means_the_engine_says_so(model):
    async def body(engine):
        _slow_steps(engine)
        streams = asyncio.ensure_future(_stream_all(engine, 4, 200))
        await wait_until(lambda: engine.stats().num_generation_tokens > 4)
        os.kill(engine.engine.backend.worker_pid, signal.SIGKILL)
        results = await streams
        assert all(isinstance(r, (RequestFailedError, EngineDeadError)) for r in results)
        assert "max_worker_restarts=0" in str(results[0])
        await wait_until(lambda: not engine.is_running, timeout=10)
        assert "max_worker_restarts=0" in engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request(PROMPTS[0], GREEDY)

    with_engine(model, body, backend_options=WORKER, max_worker_restarts=0)


def test_health_endpoint_follows_the_worker(model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from cadence.server.app import build_app

    async def body(engine):
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            os.kill(engine.engine.backend.worker_pid, signal.SIGKILL)
            r = await client.get("/health")
            deadline = time.monotonic() + 1
            while r.status_code == 200 and time.monotonic() < deadline:
                r = await client.get("/health")
            assert r.status_code == 503, r.text
            assert "worker" in r.json()["error"]["message"]
            await wait_until(lambda: engine.check_health() is None, timeout=RESTART_S)
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text

    with_engine(model, body, backend_options=WORKER)


def test_a_failed_request_is_a_500_and_the_others_are_served(model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from cadence.server.app import build_app

    async def body(engine):
        _poison(engine.engine)
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            good = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
            bad = {**good, "temperature": 1.0, "seed": POISON_SEED}
            r_bad, r_ok, r_stream = await asyncio.gather(
                client.post("/v1/completions", json=bad),
                client.post("/v1/completions", json=good),
                client.post("/v1/completions", json={**bad, "stream": True}))
            assert r_ok.status_code == 200, r_ok.text
            assert r_bad.status_code == 500, r_bad.text
            err = r_bad.json()["error"]
            assert err["type"] == "server_error" and "poisoned" in err["message"]
            # Streaming: the error arrives as an event, then the stream ends.
            assert r_stream.status_code == 200 and "poisoned" in r_stream.text
        assert all_blocks_free(engine)

    with_engine(model, body)


def test_the_idle_loop_does_not_spin(model):
    """With requests that cannot be scheduled (blocks only an abort frees) the engine thread
    sleeps on its queue instead of stepping in a loop."""
    async def body(engine):
        eng = engine.engine
        steps_before = eng.stats.num_steps
        # A live request the scheduler has nothing for (as when every waiting request needs
        # blocks that are not free): the bookkeeping says "unfinished", nothing can run.
        eng.output_processor.parents["ghost"] = None
        await engine.abort("nobody")  # wake the loop
        await asyncio.sleep(0.3)
        t0 = eng.stats.times.num_steps
        await asyncio.sleep(1.5)
        assert eng.stats.times.num_steps - t0 <= 3, "the loop kept stepping while stalled"
        del eng.output_processor.parents["ghost"]
        assert eng.stats.num_steps == steps_before

    with_engine(model, body)


def test_device_errors_are_classified(model):
    """Sticky device errors end the engine (no in-process restart); others fail a step."""
    from cadence.backends.cuda.backend import CUDA_STICKY_ERRORS
    from cadence.backends.hpu.backend import HPU_STICKY_ERRORS

    cuda_error = ("CUDA error: an illegal memory access was encountered\n"
                  "Compile with TORCH_USE_CUDA_DSA")
    for markers, text in ((CUDA_STICKY_ERRORS, cuda_error),
                          (HPU_STICKY_ERRORS, "synStatus 26 [Device reset]")):
        with pytest.raises(WorkerLostError) as info:
            raise_if_device_lost(RuntimeError(text), markers, "the device")
        assert not info.value.restartable and text.splitlines()[0] in str(info.value)
    # Out of memory fails the step only: it returns, and the caller re-raises it.
    raise_if_device_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                         CUDA_STICKY_ERRORS, "the CUDA context")


def test_step_timeout_and_restarts_are_validated():
    with pytest.raises(ValueError, match="step_timeout must be a number of seconds"):
        EngineArgs(step_timeout=0).create_engine_config()
    with pytest.raises(ValueError, match="max_worker_restarts"):
        EngineArgs(max_worker_restarts=-1).create_engine_config()


class _FailingDevice:
    """The CUDA backend's four device steps, failing at launch with ``message``."""

    def __init__(self, message: str) -> None:
        self.message = message

    def launch(self, mi):
        raise RuntimeError(self.message)

    def sample(self, logits, sampling):
        raise AssertionError("not reached")

    start_copy = finish_copy = sample


@pytest.mark.parametrize("message,lost", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA out of memory. Tried to allocate 20.00 GiB", False)])
def test_cuda_execute_reports_a_poisoned_context_as_lost(message, lost):
    from cadence.backend import ModelInput, PostSample, SamplingMetadata
    from cadence.backends.cuda.backend import CudaBackend

    backend = object.__new__(CudaBackend)  # no GPU: skip __init__, drive the device steps
    fake = _FailingDevice(message)
    backend.launch, backend.sample = fake.launch, fake.sample
    backend.start_copy, backend.finish_copy = fake.start_copy, fake.finish_copy
    backend.event_log = None
    mi = ModelInput([1], [0], [0], [1], [1], [[0]], 1, [0],
                    SamplingMetadata([0.0], [0], [1.0], [0.0], [None], [0], True))
    with pytest.raises(WorkerLostError if lost else RuntimeError) as info:
        backend.execute(mi, PostSample(None))
    assert isinstance(info.value, WorkerLostError) == lost
    if lost:
        assert not info.value.restartable and "illegal memory access" in str(info.value)


def test_hpu_device_reset_ends_the_engine_plainly_and_other_errors_fail_a_step(
        model, clean, monkeypatch):
    from cadence.faults import EngineFailedError

    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    llm = make_llm(model, backend="hpu", max_num_seqs=4)
    backend = llm.engine.backend
    real, calls = backend._execute, [0]

    def flaky(mi, post_sample):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("graph compilation failed for this shape")  # a step only
        if calls[0] == 40:
            raise RuntimeError("synStatus 26 [Device reset]")  # the device is gone
        return real(mi, post_sample)

    backend._execute = flaky
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [clean[p] for p in PROMPTS]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with pytest.raises(EngineFailedError, match="cannot restart") as info:
        llm.generate(PROMPTS, long, use_tqdm=False)
    assert "Device reset" in str(info.value)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    llm.shutdown()


def _worker_children() -> list[int]:
    """This process's CPU forward workers that have not exited."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if (int(fields[1]) == os.getpid() and fields[0] != "Z"
                and b"cadence.backends.cpu.worker" in cmdline):
            found.append(int(entry))
    return found


def test_a_start_that_fails_after_the_worker_started_stops_it(model, tmp_path):
    """The worker starts loading before the tokenizer does; a tokenizer that fails to load
    must not leave it running (a worker killed later, mid-build, used to stall every later
    kernel load)."""
    before = set(_worker_children())
    broken = tmp_path / "tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="the tokenizer in .* could not be loaded") as failure:
        make_llm(model, tokenizer=str(broken), backend_options=WORKER)
    # Checked while the traceback (and through it the engine) is alive: collecting the
    # engine would kill the worker too, and hide a start that forgot it.
    assert failure.value is not None
    assert set(_worker_children()) <= before, "the worker outlived the failed start"


def test_killing_a_worker_kills_what_it_started(tmp_path, monkeypatch):
    """A worker killed mid-build takes its compilers with it: they would otherwise go on
    writing into the build folder beside the next build there."""
    from cadence.executor.pipes import kill_worker, start_worker

    (tmp_path / "spawner.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    proc = start_worker("spawner")
    grandchild = int(proc.stdout.readline())
    assert not _gone(grandchild)
    kill_worker(proc)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild), "the worker's own child outlived it"


def _frozen_at_start(monkeypatch, module, which: int) -> list[int]:
    """Make ``module``'s ``start_worker`` freeze its ``which``-th process (SIGSTOP) right after
    starting it: a worker stuck in its start. Returns the pids it started."""
    from cadence.executor.pipes import start_worker

    pids: list[int] = []

    def start(name):
        proc = start_worker(name)
        pids.append(proc.pid)
        if len(pids) == which + 1:
            os.kill(proc.pid, signal.SIGSTOP)
        return proc

    monkeypatch.setattr(module, "start_worker", start)
    return pids


def test_a_worker_stuck_in_its_start_fails_the_start(model, monkeypatch, caplog):
    from cadence.backends.cpu import worker

    pids = _frozen_at_start(monkeypatch, worker, 0)
    monkeypatch.setattr(worker, "START_NOTICE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not ready within 1\.5 s \(--startup-timeout, "
                                           r"startup_timeout\); "
                                           "it was killed"):
        make_llm(model, backend_options=WORKER, startup_timeout=1.5)
    assert time.monotonic() - start < 60
    assert _gone(pids[0])
    assert any("is still starting after" in r.getMessage() for r in caplog.records)


def test_a_rank_stuck_in_its_start_fails_the_start(model, monkeypatch, caplog):
    from cadence.executor import multiproc, rank_group

    pids = _frozen_at_start(monkeypatch, multiproc, 1)
    monkeypatch.setattr(rank_group, "START_NOTICE_S", 1.0)
    # Rank 0 waits for rank 1 in the rendezvous: neither is ready.
    with pytest.raises(WorkerLostError, match=r"rank\(s\) \[0, 1\] of 2 were not ready within "
                                              r"3 s \(--startup-timeout, startup_timeout\); "
                                              "every rank was killed"):
        make_llm(model, tensor_parallel_size=2, num_kv_blocks=64, startup_timeout=3)
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)
    assert any("rank(s) [0, 1] of 2 still starting after" in r.getMessage()
               for r in caplog.records)


def test_a_worker_whose_engine_died_exits(tmp_path, monkeypatch):
    """A worker leads its own process group, out of reach of the signals sent to the
    engine's; when the engine dies (SIGKILL, mid-start) the worker must go too, with what it
    started, not go on loading a model for nobody."""
    import subprocess
    import sys

    (tmp_path / "loading.py").write_text(
        "import subprocess, time\n"
        "from cadence.executor.pipes import exit_with_parent\n"
        "exit_with_parent()\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)  # a long load that reads no stdin\n")
    (tmp_path / "engine.py").write_text(
        "import os, time\n"
        "from cadence.executor.pipes import start_worker\n"
        "proc = start_worker('loading')\n"
        "print(proc.pid, proc.stdout.readline().decode().strip(), flush=True)\n"
        "time.sleep(300)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    engine = subprocess.Popen([sys.executable, "-m", "engine"], stdout=subprocess.PIPE,
                              text=True)
    worker, grandchild = (int(x) for x in engine.stdout.readline().split())
    assert not _gone(worker) and not _gone(grandchild)
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + 15
    while not (_gone(worker) and _gone(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker), "the worker outlived its engine"
    assert _gone(grandchild), "what the worker started outlived it"


def test_post_sample_called_twice_is_the_backends_bug_not_a_requests(model):
    """A backend that calls post_sample twice in a step breaks the contract: the engine
    stops and names the bug, rather than re-running the step in halves and failing some
    request for it."""
    from cadence.faults import EngineFailedError

    llm = make_llm(model)
    try:
        engine = llm.engine
        execute = engine.backend.execute
        calls = []

        def twice(mi, post_sample):
            calls.append(len(mi.request_ids))
            out = execute(mi, post_sample)
            post_sample()
            return out

        engine.backend.execute = twice
        with pytest.raises(EngineFailedError, match="post_sample called twice in one step"):
            _run_engine(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
        # One step, not the step re-run in halves to find a request to blame; every
        # request ends alike.
        assert calls == [len(PROMPTS)]
        assert engine.stats.finish_reasons == {"error": len(PROMPTS)}
    finally:
        llm.shutdown()
