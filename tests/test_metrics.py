"""/metrics through prometheus_client: every family keeps its name and type, carries the
model_name and backend labels, and counts exactly what was served (requests, tokens,
finish reasons, one inter-token-latency observation per gap between output tokens)."""

from __future__ import annotations

import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")
pytest.importorskip("prometheus_client", reason="the server tests need the server extra")

from prometheus_client.parser import text_string_to_metric_families
from test_async_engine import with_engine

from cadence import SamplingParams
from cadence.metrics import STEP_PHASES
from cadence.output_state import OutputKind
from cadence.server.app import build_app

PROMPTS = ["the quick brown fox", "a small bird sings", "hello there"]
LABELS = {"model_name": "tiny", "backend": "cpu", "engine": "0"}
HISTOGRAMS = ["time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_time_per_output_token_seconds",
              "inter_token_latency_seconds", "time_per_output_token_seconds"]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


async def _served(client, engine) -> list[int]:
    """Send requests that finish by length, by a stop token and by an abort; return the
    number of output tokens of each sample."""
    lengths = []
    r = await client.post("/v1/completions", json={
        "prompt": PROMPTS, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    lengths += [5] * len(PROMPTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [o async for o in engine.generate(PROMPTS[2], greedy,
                                            output_kind=OutputKind.FINAL_ONLY)][-1]
    ids = ref.outputs[0].token_ids
    lengths.append(len(ids))
    r = await client.post("/v1/completions", json={
        "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": [ids[2]]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    lengths.append(r.json()["usage"]["completion_tokens"])
    # The abort: a long request, aborted once it has produced something.
    stream = await engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200,
                                                                 ignore_eos=True),
                                      request_id="to-abort", output_kind=OutputKind.CUMULATIVE)
    final = None
    async for out in stream:
        if out.outputs[0].token_ids and final is None:
            final = out
            await engine.abort("to-abort")
        final = out
    assert final.finished and final.outputs[0].finish_reason == "abort"
    lengths.append(len(final.outputs[0].token_ids))
    return lengths


def _scrape(model: str):
    async def run(engine):
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            lengths = await _served(client, engine)
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            prompt_tokens = engine.stats().num_prompt_tokens
            return lengths, prompt_tokens, r.text

    return with_engine(model, run)


@pytest.fixture(scope="module")
def scraped(model):
    lengths, prompt_tokens, text = _scrape(model)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return lengths, prompt_tokens, families


def _value(families, name: str, suffix: str = "", **labels) -> float:
    want = {**LABELS, **labels}
    found = [s.value for s in families[name].samples
             if s.name == name + suffix and s.labels == want]
    assert len(found) == 1, (name, suffix, labels)
    return found[0]


def test_every_family_has_its_type_and_the_model_and_backend_labels(scraped):
    _, _, families = scraped
    types = {
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        **{f"vllm:step_{p}_seconds": "counter" for p in STEP_PHASES},
        **{f"vllm:{h}": "histogram" for h in HISTOGRAMS},
    }
    assert {name: f.type for name, f in families.items()} == types
    for f in families.values():
        assert f.samples
        for s in f.samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS, s


def test_counts_match_what_was_served(scraped):
    lengths, prompt_tokens, families = scraped
    assert _value(families, "vllm:generation_tokens", "_total") == sum(lengths)
    assert _value(families, "vllm:prompt_tokens", "_total") == prompt_tokens > 0
    reasons = {s.labels["finished_reason"]: s.value
               for s in families["vllm:request_success"].samples}
    assert reasons == {"length": 4, "stop": 1, "abort": 1}
    assert _value(families, "vllm:num_preemptions", "_total") == 0
    assert _value(families, "vllm:num_requests_running") == 0
    assert _value(families, "vllm:num_requests_waiting") == 0
    assert 0 <= _value(families, "vllm:kv_cache_usage_perc") <= 1
    assert _value(families, "vllm:step_execute_seconds", "_total") > 0


def test_histograms_are_consistent_and_count_each_observation(scraped):
    lengths, _, families = scraped
    want_counts = {
        "time_to_first_token_seconds": len(lengths),
        "e2e_request_latency_seconds": len(lengths),
        "request_queue_time_seconds": len(lengths),
        "request_time_per_output_token_seconds": sum(n > 1 for n in lengths),
        "inter_token_latency_seconds": sum(n - 1 for n in lengths),
        # vLLM's older name of the per-gap histogram, filled with every gap as vLLM fills it.
        "time_per_output_token_seconds": sum(n - 1 for n in lengths),
    }
    for short, count in want_counts.items():
        name = f"vllm:{short}"
        assert _value(families, name, "_count") == count, name
        buckets = [(s.labels["le"], s.value) for s in families[name].samples
                   if s.name == name + "_bucket"]
        assert buckets[-1] == ("+Inf", count)
        values = [v for _, v in buckets]
        assert values == sorted(values), name  # cumulative
        edges = [float(le) for le, _ in buckets]
        assert edges == sorted(edges) and len(set(edges)) == len(edges)
        total = _value(families, name, "_sum")
        assert total >= 0 and (total > 0) == (count > 0), name


def test_import_cadence_does_not_import_prometheus_client():
    out = subprocess.run(
        [sys.executable, "-c", ("import sys, cadence, cadence.metrics, cadence.async_engine; "
                                "print('prometheus_client' in sys.modules)")],
        check=True, capture_output=True, text=True, cwd="/").stdout
    assert out.strip() == "False"


def test_the_prefix_can_be_cadences_own():
    from cadence.metrics import EngineStats
    from cadence.server.metrics import make_registry

    registry = make_registry(lambda: [EngineStats()], "m", lambda: "cpu", "cadence")
    names = {m.name for m in registry.collect()}
    assert "cadence:num_requests_running" in names
    assert not any(n.startswith("vllm:") for n in names)
    with pytest.raises(ValueError, match="metrics prefix must be one of"):
        make_registry(lambda: [EngineStats()], "m", lambda: "cpu", "tgi")
