"""The HPU backend without a Gaudi: probe and env defaults, the lazy-mode call order, and the
whole engine through the emulation (CADENCE_HPU_EMULATE=1) against the CPU backend.

Tests marked ``hpu`` need a real Gaudi and skip with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from cadence.backend import ModelInput, PostSample, SamplerOutput, SamplingMetadata

_PROBE_SCRIPT = """
import json, os, sys
import cadence.backends.hpu as plugin
found = []
plugin.cadence_register_backends(register=found.append)
probe = found[0].probe()
print(json.dumps({"available": probe.available, "reason": probe.reason,
                  "lazy": os.environ.get("PT_HPU_LAZY_MODE"),
                  "imported": sorted(m for m in ("torch", "habana_frameworks") if m in sys.modules)}))
"""


def _probe_in_subprocess(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CADENCE_HPU_EMULATE", "PT_HPU_LAZY_MODE")}
    out = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_probe_imports_neither_torch_nor_the_bridge_and_keeps_user_env() -> None:
    res = _probe_in_subprocess()
    assert res["imported"] == []
    assert res["lazy"] == "1"  # the default is applied when unset
    if importlib.util.find_spec("habana_frameworks") is None:
        assert not res["available"] and "habana_frameworks is not installed" in res["reason"]
    res = _probe_in_subprocess(CADENCE_HPU_EMULATE="1", PT_HPU_LAZY_MODE="0")
    assert res["available"] and "emulated" in res["reason"] and res["imported"] == []
    assert res["lazy"] == "0"  # never overrides the user's value


def test_env_defaults_only_fill_gaps() -> None:
    from cadence.backends.hpu import apply_env_defaults

    env = {"PT_HPU_LAZY_MODE": "0"}
    apply_env_defaults(env)
    assert env == {"PT_HPU_LAZY_MODE": "0"}
    env = {}
    apply_env_defaults(env)
    assert env == {"PT_HPU_LAZY_MODE": "1"}


def test_cli_flags_reach_backend_options() -> None:
    import argparse

    import cadence.backends.hpu as plugin

    parser = argparse.ArgumentParser()
    plugin.cadence_add_cli_options(parser)
    args = vars(parser.parse_args(["--hpu-bucketing", "linear", "--hpu-decode-bs", "1:8:64",
                                   "--hpu-skip-warmup"]))
    config = {"backend": "hpu", "dtype": "float32", **args}
    plugin.cadence_configure(config)
    assert config["backend_options"] == {"bucketing": "linear", "decode_bs": "1:8:64",
                                         "skip_warmup": True}
    other = {"backend": "cpu", **args}
    plugin.cadence_configure(other)
    assert "backend_options" not in other


def _config(**options):
    from cadence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(ModelConfig("unused", max_model_len=64), CacheConfig(block_size=4),
                        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                        max_model_len=64),
                        backend="hpu", backend_options=tuple(options.items()))


@pytest.mark.parametrize("lazy", ["1", "0"])
def test_overlap_call_order(monkeypatch: pytest.MonkeyPatch, lazy: str) -> None:
    """The strategy against a recorded log; the device work itself is stubbed out."""
    from cadence.backends.hpu.backend import HpuBackend

    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    backend = HpuBackend(_config(record_events=True))
    log = backend.event_log
    monkeypatch.setattr(backend, "_split", lambda mi: [])
    monkeypatch.setattr(backend, "_run_parts", lambda parts: log.append("device:forward"))
    monkeypatch.setattr(backend, "_sample_parts", lambda parts, m: log.append("device:sample"))
    monkeypatch.setattr(backend, "_host_parts", lambda parts, n: SamplerOutput([]))
    meta = SamplingMetadata([], [], [], [], [], [], True)
    mi = ModelInput([], [], [], [], [], [], 0, [], meta)
    post = PostSample(lambda: log.append("callback"))
    backend.execute(mi, post)
    assert post.called
    if lazy == "1":
        assert log == ["forward", "device:forward", "mark_step", "post_sample", "callback",
                       "sample", "device:sample", "mark_step", "to_host"]
        assert backend.device.num_mark_steps == 2
    else:
        assert log == ["forward", "device:forward", "post_sample", "callback", "sample",
                       "device:sample", "to_host"]
        assert backend.device.num_mark_steps == 0


def test_expand_sampling_pads_with_greedy_rows() -> None:
    from cadence.backends.hpu.backend import expand_sampling

    meta = SamplingMetadata([0.7, 0.0], [5, 0], [0.9, 1.0], [0.0, 0.1], [3, None], [2, 0],
                            False, num_logprobs=[1, -1], max_num_logprobs=1)
    out = expand_sampling(meta, [1, None, 0, None])
    assert out.temperature == [0.0, 0.0, 0.7, 0.0] and out.seeds == [None, None, 3, None]
    assert out.num_logprobs == [-1, -1, 1, -1] and out.repetition_penalty == []


# --- the whole engine through the emulation -------------------------------------------------

PROMPTS = ["the cat runs over the quiet river and the old moon " * 4, "a dog sings",
           "blue", "the cat runs over the quiet river and the old moon " * 4 + "near the city"]

# name -> (backend options, PT_HPU_LAZY_MODE)
BUCKET_CONFIGS = {
    "exponential": ({}, "1"),
    "linear-eager": ({"bucketing": "linear", "prompt_seq": "8:32:64",
                      "decode_blocks": "1:4:8"}, "0"),
    # Ranges too small for the workload: shapes past them still run (compiled at run time).
    "narrow": ({"prompt_bs": "1:1:2", "prompt_seq": "16:16:32", "decode_blocks": "2:2:4",
                "decode_bs": "1:1:2"}, "1"),
}


def _run(model: str, backend: str, options: dict | None = None, **kw):
    from cadence import SamplingParams
    from engine_helpers import generate, make_llm

    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", 128)
    # Chunked prefill (64-token budget) and prefix-cache hits (prompts 0 and 3) exercise
    # the prefill-with-context graph too.
    kw.setdefault("max_num_batched_tokens", 64)
    if backend == "hpu":
        kw["backend_options"] = {"record_events": True, **(options or {})}
    llm = make_llm(model, backend=backend, **kw)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)]
    outs = generate(llm, PROMPTS, params)
    return llm, [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def emulated(tiny: str):
    """``emulated(name, **kw)`` -> (llm, token ids), run once per argument set."""
    cache: dict = {}

    def run(name: str, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            options, lazy = BUCKET_CONFIGS[name]
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("CADENCE_HPU_EMULATE", "1")
                mp.setenv("PT_HPU_LAZY_MODE", lazy)
                cache[key] = _run(tiny, "hpu", options, **kw)
        return cache[key]

    return run


@pytest.mark.parametrize("name", list(BUCKET_CONFIGS))
def test_emulated_engine_matches_cpu(tiny: str, emulated, name: str) -> None:
    cpu_reference = _run(tiny, "cpu")[1] if name == "exponential" else None
    llm, got = emulated(name)
    if cpu_reference is not None:
        greedy = [0, 1, 3]
        assert [got[i] for i in greedy] == [cpu_reference[i] for i in greedy]
    else:
        # Same greedy tokens as the first config, hence as the CPU backend.
        first = emulated("exponential")[1]
        assert [got[i] for i in (0, 1, 3)] == [first[i] for i in (0, 1, 3)]
    backend = llm.engine.backend
    assert backend.num_warmup_compiles > 0
    if name != "narrow":
        assert backend.recompiles_after_warmup() == 0
    # Every step followed the strategy's order.
    step = ["forward", "mark_step", "post_sample", "sample", "mark_step", "to_host"]
    if BUCKET_CONFIGS[name][1] == "0":
        step = [e for e in step if e != "mark_step"]
    log = backend.event_log
    assert len(log) % len(step) == 0 and log == step * (len(log) // len(step))


def test_emulated_async_on_equals_off(emulated) -> None:
    on = emulated("narrow")[1]
    off = emulated("narrow", disable_async_output_proc=True)[1]
    assert on == off  # the seeded sampled request included


@pytest.mark.parametrize(("name", "async_scheduling"),
                         [("exponential", False), ("linear-eager", True)])
def test_emulated_prompt_logprobs_match_cpu(tiny: str, name: str,
                                            async_scheduling: bool) -> None:
    """Prompt logprobs from the prefill graphs that return their hidden states: chunked
    prompts (a 64-token budget), a prefill with context, mixed with requests that ask for
    none or for another number of top entries, equal to the CPU backend's."""
    from engine_helpers import assert_same_prompt_logprobs, generate, make_llm

    from cadence import SamplingParams

    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)]
    kw = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 64}
    cpu = make_llm(tiny, **kw)
    try:
        want = generate(cpu, PROMPTS, params)
    finally:
        cpu.shutdown()
    options, lazy = BUCKET_CONFIGS[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CADENCE_HPU_EMULATE", "1")
        mp.setenv("PT_HPU_LAZY_MODE", lazy)
        llm = make_llm(tiny, backend="hpu", backend_options=options,
                       async_scheduling=async_scheduling, **kw)
        try:
            got = generate(llm, PROMPTS, params)
        finally:
            llm.shutdown()
    assert [a.outputs[0].token_ids for a in got] == [b.outputs[0].token_ids for b in want]
    assert_same_prompt_logprobs(got, want)


@pytest.mark.parametrize(("name", "async_scheduling"),
                         [("exponential", False), ("linear-eager", True)])
def test_emulated_embeddings_match_cpu(tiny: str, name: str, async_scheduling: bool) -> None:
    """Embeddings from the graphs that return their hidden states: chunked prompts, a
    prefill with context, and a prefix-cache hit that leaves one token (a decode part),
    beside a generation request; equal to the CPU backend's."""
    from engine_helpers import assert_same_embeddings, make_llm

    from cadence import PoolingParams, SamplingParams

    long = list(range(5, 38))  # 33 tokens: a repeat hits two blocks and computes one
    prompts = [{"prompt_token_ids": p} for p in (long, list(range(40, 110)), long)]
    raw = PoolingParams(normalize=False)
    kw = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 64}
    cpu = make_llm(tiny, **kw)
    try:
        want = cpu.embed(prompts, raw, use_tqdm=False)
    finally:
        cpu.shutdown()
    options, lazy = BUCKET_CONFIGS[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CADENCE_HPU_EMULATE", "1")
        mp.setenv("PT_HPU_LAZY_MODE", lazy)
        llm = make_llm(tiny, backend="hpu", backend_options=options,
                       async_scheduling=async_scheduling, **kw)
        try:
            llm.engine.add_request("g", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True))
            got = llm.embed(prompts[:2], raw, use_tqdm=False)
            (again,) = llm.embed(prompts[2:], raw, use_tqdm=False)
            assert again.num_cached_tokens == 32
            assert_same_embeddings([*got, again], want)
            assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        finally:
            llm.shutdown()


@pytest.mark.parametrize("warm", [False, True])
def test_warmup_hidden_compiles_the_graphs_that_return_hidden_states(tiny: str,
                                                                     warm: bool) -> None:
    """Embeddings run graphs that also return hidden states: compiled at their first use,
    or at start-up with ``warmup_hidden``, after which they compile nothing more."""
    from engine_helpers import make_llm

    from cadence import PoolingParams

    options = {"prompt_bs": "1:1:2", "prompt_seq": "16:16:32", "decode_bs": "1:1:2",
               "decode_blocks": "2:2:4", "warmup_hidden": warm}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CADENCE_HPU_EMULATE", "1")
        mp.setenv("PT_HPU_LAZY_MODE", "1")
        llm = make_llm(tiny, backend="hpu", backend_options=options, max_num_seqs=2,
                       max_model_len=64, max_num_batched_tokens=32)
        try:
            backend = llm.engine.backend
            warmed = backend.num_warmup_compiles
            llm.embed([{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 20)],
                      PoolingParams(), use_tqdm=False)
            recompiled = backend.recompiles_after_warmup()
        finally:
            llm.shutdown()
    if warm:
        assert recompiled == 0 and warmed > 0
    else:
        assert recompiled > 0


def _has_gaudi() -> bool:
    from cadence.backends.hpu.backend import emulation_requested

    return not emulation_requested() and importlib.util.find_spec("habana_frameworks") is not None


@pytest.mark.hpu
@pytest.mark.skipif(not _has_gaudi(), reason="needs a Habana Gaudi with habana_frameworks "
                                             "(and CADENCE_HPU_EMULATE unset)")
def test_no_recompiles_after_warmup_on_gaudi(tiny: str) -> None:
    llm, _ = _run(tiny, "hpu", {}, dtype="bfloat16")
    backend = llm.engine.backend
    assert backend.num_warmup_compiles >= 0, "graph-compilation metric unavailable"
    assert backend.recompiles_after_warmup() == 0
