"""The backend conformance checks: what every cadence backend must satisfy.

Each ``test_*`` function is one check of the contract in ``cadence.backend.Backend``. They
use the fixtures of ``cadence.testing.pytest_plugin`` and run against the backend named by
``--cadence-backend``. Two documented ways to run them::

    pytest --pyargs cadence.testing.conformance --cadence-backend NAME
    # or, in a test module of your own package:  from cadence.testing.conformance import *
    pytest --cadence-backend NAME

The checks of the optional features (prompt logprobs, embeddings, LoRA, speculative
decoding, quantized weights) live in ``cadence.testing.conformance_features`` and are
collected here too. The helpers they use live in ``cadence.testing.helpers``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cadence.backend import PostSample
from cadence.testing import conformance_features
from cadence.testing.conformance_features import *  # collected from here too
from cadence.testing.helpers import (
    PROMPTS,
    WORKLOADS,
    assert_all_blocks_free,
    assert_same_tokens,
    cached_workload,
    probe_in_subprocess,
    run_workload,
    summarize,
    workload_params,
)

__all__ = [
    "test_a_sliding_window_model_matches_cpu_reference",
    "test_async_scheduling_equals_sync_or_is_refused",
    "test_batch_composition_and_padding_do_not_change_outputs",
    "test_core_calls_post_sample_when_backend_never_does",
    "test_every_kv_block_is_free_after_requests",
    "test_greedy_matches_cpu_reference",
    "test_logit_bias_and_allowed_ids_steer_only_their_rows",
    "test_overlap_on_equals_off",
    "test_post_sample_at_most_once_per_step_on_engine_thread",
    "test_probe_never_initialises_the_device",
    "test_registration_is_idempotent",
    "test_structured_output_follows_its_constraint",
    "test_the_kv_cache_has_the_blocks_asked_for",
]
__all__ += conformance_features.__all__  # the optional features' checks, collected here too


class _SpyPostSample(PostSample):
    """Counts calls and calling threads, then forwards to the engine's ``PostSample``."""

    __slots__ = ("num_calls", "threads")

    def __init__(self, inner: PostSample) -> None:
        super().__init__(inner)
        self.num_calls = 0
        self.threads: list[int] = []

    def __call__(self) -> None:
        self.num_calls += 1
        self.threads.append(threading.get_ident())
        super().__call__()


def _spy_on_execute(backend: Any, spies: list[tuple[_SpyPostSample, PostSample, int]]) -> None:
    original = backend.execute

    def execute(model_input: Any, post_sample: PostSample) -> Any:
        spy = _SpyPostSample(post_sample)
        spies.append((spy, post_sample, threading.get_ident()))
        return original(model_input, spy)

    backend.execute = execute  # instance attribute: removed again with ``del``


def test_post_sample_at_most_once_per_step_on_engine_thread(cadence_llm: Any) -> None:
    """post_sample runs at most once per step, on the thread that called ``execute``."""
    spies: list[tuple[_SpyPostSample, PostSample, int]] = []
    backend = cadence_llm.engine.backend
    _spy_on_execute(backend, spies)
    try:
        run_workload(cadence_llm, "seeded")
    except RuntimeError as e:
        pytest.fail(f"post_sample was called twice in one step: {e}")
    finally:
        del backend.execute
    assert spies, "the engine never called Backend.execute"
    for step, (spy, original, engine_thread) in enumerate(spies):
        assert spy.num_calls <= 1, f"step {step}: post_sample called {spy.num_calls} times"
        assert all(t == engine_thread for t in spy.threads), (
            f"step {step}: post_sample ran on thread {spy.threads}, not on the engine thread "
            f"{engine_thread} that called execute")
        assert original.called, f"step {step}: the step's post_sample never ran"


def test_core_calls_post_sample_when_backend_never_does(
        cadence_llm: Any, cadence_reference: dict, cadence_logprob_atol: float) -> None:
    """A subclass whose ``execute`` never calls post_sample still gives the right outputs:
    the engine calls it after ``execute`` returns."""
    backend = cadence_llm.engine.backend
    cls = type(backend)

    class NeverCallsPostSample(cls):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def execute(self, model_input: Any, post_sample: PostSample) -> Any:
            return self.to_host(self.sample(self.forward(model_input), model_input.sampling))

    spies: list[tuple[_SpyPostSample, PostSample, int]] = []
    backend.__class__ = NeverCallsPostSample
    _spy_on_execute(backend, spies)
    try:
        outputs = run_workload(cadence_llm, "greedy")
    finally:
        del backend.execute
        backend.__class__ = cls
    assert all(spy.num_calls == 0 and original.called for spy, original, _ in spies)
    assert_same_tokens(outputs, cadence_reference["greedy"], cadence_logprob_atol,
                       "never-calls-post_sample vs CPU reference")


def test_greedy_matches_cpu_reference(cadence_llm: Any, cadence_reference: dict,
                                      cadence_logprob_atol: float) -> None:
    """Greedy tokens equal the CPU backend's sync strategy on the same weights."""
    outputs = cached_workload(cadence_llm, "greedy")
    assert_same_tokens(outputs, cadence_reference["greedy"], cadence_logprob_atol,
                       "backend vs CPU reference")


def test_a_sliding_window_model_matches_cpu_reference(
        cadence_window_model_dir: str, cadence_window_reference: list[Any],
        cadence_backend: str, cadence_backend_options: dict[str, Any],
        cadence_logprob_atol: float) -> None:
    """On a Mistral whose window is shorter than the prompts, greedy tokens equal the CPU
    backend's: the attention's ``sliding_window`` is honoured, in prefill chunks and decode
    alike (and the blocks behind the window, freed as requests run, are never read)."""
    from cadence.testing.pytest_plugin import _make_llm

    llm = _make_llm(cadence_window_model_dir, cadence_backend,
                    backend_options=cadence_backend_options)
    try:
        outputs = run_workload(llm, "greedy")
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    assert_same_tokens(outputs, cadence_window_reference, cadence_logprob_atol,
                       "backend vs CPU reference, sliding window")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_overlap_on_equals_off(cadence_llm: Any, cadence_llm_sync: Any, workload: str) -> None:
    """Async output processing on and off give identical outputs (tokens, text, logprobs,
    finish reasons), greedy and seeded, under preemption and chunked prefill."""
    on = summarize(cached_workload(cadence_llm, workload))
    off = summarize(cached_workload(cadence_llm_sync, workload))
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"prompt {i}: async on {a}\n != async off {b}"
    assert len(on) == len(off)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_async_scheduling_equals_sync_or_is_refused(
        cadence_backend: str, cadence_model_dir: str, cadence_backend_options: dict[str, Any],
        cadence_llm_sync: Any, workload: str) -> None:
    """A backend that declares ``supports_async_scheduling`` gives identical outputs with
    async scheduling (step N+1 planned on placeholders while step N computes), greedy and
    seeded, under preemption and chunked prefill, with every block free at the end. One
    that does not is refused at start-up with an error naming the backends that can."""
    from cadence.plugins import get_registry
    from cadence.testing.pytest_plugin import _make_llm

    cls = get_registry().backends[cadence_backend].cls
    if not getattr(cls, "supports_async_scheduling", False):
        with pytest.raises(ValueError, match="async_scheduling is not supported"):
            _make_llm(cadence_model_dir, cadence_backend, async_scheduling=True,
                      backend_options=cadence_backend_options)
        return
    llm = _make_llm(cadence_model_dir, cadence_backend, async_scheduling=True,
                    backend_options=cadence_backend_options)
    try:
        got = summarize(run_workload(llm, workload))
    finally:
        llm.shutdown()
    want = summarize(cached_workload(cadence_llm_sync, workload))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"prompt {i}: async scheduling {a}\n != sync {b}"
    assert len(got) == len(want)


def test_batch_composition_and_padding_do_not_change_outputs(
        cadence_llm: Any, cadence_logprob_atol: float) -> None:
    """The same prompt gives the same greedy tokens alone, in the full batch, and in another
    batch order: padding to a shape bucket (or a graph's batch size) must not leak."""
    full = cached_workload(cadence_llm, "greedy")
    reordered_ids = [5, 0, 7, 2, 3]
    reordered = run_workload(cadence_llm, "greedy", order=reordered_ids)
    assert_same_tokens(reordered, [full[i] for i in reordered_ids], cadence_logprob_atol,
                       "reordered batch vs full batch")
    for i in (6, 7):
        alone = run_workload(cadence_llm, "greedy", order=[i])
        assert_same_tokens(alone, [full[i]], cadence_logprob_atol, f"prompt {i} alone")


def test_structured_output_follows_its_constraint(cadence_llm: Any) -> None:
    """Constrained requests sample only what their grammar allows: the backend applies the
    bitmask of ``SamplingMetadata.grammar`` before sampling (the shared torch sampler in
    ``cadence.layers.sampler`` does; docs/structured_output.md). Skipped without xgrammar."""
    import re

    pytest.importorskip("xgrammar")
    from cadence import SamplingParams, StructuredOutputsParams

    regex = r"[a-c]{2,4}-[0-9]{1,2}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=regex))
              for i in range(len(PROMPTS))]
    for out in cadence_llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), \
            f"constrained output {c.text!r} ({c.finish_reason}, {out.error})"
    assert_all_blocks_free(cadence_llm)


def test_logit_bias_and_allowed_ids_steer_only_their_rows(cadence_llm: Any) -> None:
    """``SamplingParams.logit_bias`` and ``allowed_token_ids`` reach the logits of their own
    rows only (the shared sampler applies ``SamplingMetadata.logit_bias`` and
    ``allowed_token_ids``): +100 makes greedy pick the token every step, -100 on the tokens
    greedy picked makes it pick others, random sampling stays inside the allowed ids, and an
    unconstrained request in the same batch keeps its tokens."""
    from cadence import SamplingParams

    def greedy(**kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)

    (plain,) = cadence_llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    picked = plain.outputs[0].token_ids
    forced = 7 if 7 not in picked else 8
    allowed = [3, 11, 19, 27]
    outs = cadence_llm.generate(
        PROMPTS[:4], [greedy(logit_bias={forced: 100.0}),
                      greedy(logit_bias=dict.fromkeys(picked, -100.0)), greedy(),
                      SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                     allowed_token_ids=allowed)],
        use_tqdm=False)
    assert set(outs[3].outputs[0].token_ids) <= set(allowed), outs[3].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == [forced] * 6, outs[0].outputs[0].token_ids
    assert not set(outs[1].outputs[0].token_ids) & set(picked), (picked, outs[1].outputs)
    (alone,) = cadence_llm.generate(PROMPTS[2:3], greedy(), use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_free(cadence_llm)


def test_the_kv_cache_has_the_blocks_asked_for(cadence_llm: Any) -> None:
    """``LLM(num_kv_blocks=N)`` sizes the cache (the kit asks for a small one so requests
    get preempted: a backend that sizes its cache otherwise skips that coverage unseen)."""
    from cadence.testing.pytest_plugin import KIT_ENGINE_ARGS

    asked = KIT_ENGINE_ARGS["num_kv_blocks"]
    assert cadence_llm.engine.num_blocks == asked, (
        f"the engine has {cadence_llm.engine.num_blocks} KV blocks, not the {asked} asked "
        "for: allocate_kv_cache must honour config.cache_config.num_blocks "
        "(ModelRunner.num_blocks_for_bytes does)")


def test_every_kv_block_is_free_after_requests(cadence_llm: Any) -> None:
    """Blocks come back after finished, aborted (mid-decode and still waiting) requests."""
    engine = cadence_llm.engine
    params = workload_params("seeded")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"kit-free-{i}", prompt, params[i])
    for _ in range(3):
        engine.step()
    engine.abort_request("kit-free-0")
    engine.abort_request(f"kit-free-{len(PROMPTS) - 1}")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(cadence_llm)


def test_probe_never_initialises_the_device(cadence_backend: str) -> None:
    """In a fresh process, loading the plugin and probing imports no device library and
    initialises no torch device; the entry-point name equals ``Backend.name``."""
    facts = probe_in_subprocess(cadence_backend)
    assert not facts["errors"], f"plugin failed to load: {facts['errors']}"
    assert facts["found"], (
        f"no backend named {cadence_backend!r} was registered by an entry point of that name "
        f"({facts['mismatches'] or 'no such entry point is installed'}); the plugin needs an "
        "entry point in the cadence.backends group named as its Backend.name, and a "
        "cadence_register_backends hook that registers the class")
    assert facts["available"], f"probe says unavailable: {facts['reason']}"
    assert not facts["torch_imported"], (
        "importing the plugin module and calling probe() imported torch; `engine backends` "
        "and every engine start pay for that: locate it with importlib.util.find_spec "
        f"instead (modules the probe imported: {facts['imported_by_probe']})")
    assert not facts["device_modules"], f"device libraries imported: {facts['device_modules']}"
    assert not facts["cuda_initialized"], "probe (or plugin import) initialised CUDA"


def test_registration_is_idempotent(cadence_backend: str) -> None:
    """Loading the plugins again (as every worker process does) and registering the same
    plugin twice changes nothing and raises nothing."""
    from cadence.plugins import PluginRegistry

    first = PluginRegistry().load()
    assert first.load() is first
    assert cadence_backend in first.backends, (
        f"no backend {cadence_backend!r} is registered (registered: {sorted(first.backends)}; "
        f"entry points that did not register their own name: {first.mismatches()})")
    info = first.backends[cadence_backend]
    plugin = next(p for n, p in first.pm.list_name_plugin() if n == cadence_backend)
    first.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    again = PluginRegistry()
    again.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    again.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    assert again.backends[cadence_backend].cls is info.cls
    # Only the backend under test: another installed plugin's troubles are not its own.
    assert PluginRegistry().load().backends[cadence_backend] == info
    assert not [e for e in first.errors if e.entry_point == cadence_backend]
