"""The backend conformance checks: what every cadence backend must satisfy.

Each ``test_*`` function is one check of the contract in ``cadence.backend.Backend``. They
use the fixtures of ``cadence.testing.pytest_plugin`` and run against the backend named by
``--cadence-backend``. Two documented ways to run them::

    pytest --pyargs cadence.testing.conformance --cadence-backend NAME
    # or, in a test module of your own package:  from cadence.testing.conformance import *
    pytest --cadence-backend NAME

The helpers (``run_workload``, ``assert_same_tokens`` ...) are importable for your own tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import weakref
from typing import Any

import pytest

from cadence.backend import PostSample
from cadence.sampling_params import SamplingParams
from cadence.testing.tiny_model import sentences

__all__ = [
    "test_post_sample_at_most_once_per_step_on_engine_thread",
    "test_core_calls_post_sample_when_backend_never_does",
    "test_greedy_matches_cpu_reference",
    "test_overlap_on_equals_off",
    "test_batch_composition_and_padding_do_not_change_outputs",
    "test_every_kv_block_is_free_after_requests",
    "test_probe_never_initialises_the_device",
    "test_registration_is_idempotent",
]

# Prompts of 4 to ~70 tokens: some fill several KV blocks, the long one is chunked.
PROMPTS = sentences(7, seed=7) + [" ".join(sentences(5, seed=3))]
WORKLOADS = ("greedy", "seeded")
_RESULTS: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()
# Modules whose import means a probe went too far (DESIGN: probe never acquires the device).
DEVICE_MODULES = ("habana_frameworks", "torch_xla", "torch_npu", "intel_extension_for_pytorch",
                  "triton", "tensorflow", "jax")


def workload_params(name: str) -> list[SamplingParams]:
    """Per-prompt sampling parameters; different lengths so the batch shrinks step by step."""
    if name == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True,
                               logprobs=3) for i in range(len(PROMPTS))]
    if name == "seeded":
        return [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i,
                               max_tokens=5 + 2 * i, stop=[" sees", " quick"] if i % 2 else None,
                               logprobs=1) for i in range(len(PROMPTS))]
    raise ValueError(f"unknown workload {name!r}; valid: {WORKLOADS}")


def run_workload(llm: Any, name: str, order: list[int] | None = None) -> list[Any]:
    """Generate the workload (optionally a subset/ordering of the prompts), in prompt order."""
    order = list(range(len(PROMPTS))) if order is None else order
    params = workload_params(name)
    outputs = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order],
                           use_tqdm=False)
    assert_all_blocks_free(llm)
    return outputs


def cached_workload(llm: Any, name: str) -> list[Any]:
    """``run_workload(llm, name)``, computed once per LLM: outputs are deterministic, and
    several checks compare against the same full-batch run."""
    cache = _RESULTS.setdefault(llm, {})
    if name not in cache:
        cache[name] = run_workload(llm, name)
    return cache[name]


def assert_all_blocks_free(llm: Any) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks, (
        f"{engine.num_blocks - engine.block_manager.num_free_blocks} KV blocks still in use "
        "after every request finished")


def summarize(outputs: list[Any]) -> list[tuple]:
    """Everything observable about a result, for exact comparisons."""
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = [sorted((t, round(lp.logprob, 4)) for t, lp in d.items())
                   for d in c.logprobs or []]
            rows.append((c.index, tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                         lps))
    return rows


def assert_same_tokens(actual: list[Any], expected: list[Any], atol: float, what: str) -> None:
    """Greedy token ids must match; at the first difference, the two tokens must be a
    near-tie in ``expected``'s logprobs (|gap| <= atol), and the rest of that sequence is
    not compared (it continues from a different prefix)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        ta, te = a.outputs[0].token_ids, e.outputs[0].token_ids
        n = next((k for k, (x, y) in enumerate(zip(ta, te)) if x != y), None)
        if n is None:
            assert len(ta) == len(te), f"{what}: prompt {i} has {len(ta)} tokens, not {len(te)}"
            continue
        top = e.outputs[0].logprobs[n] if e.outputs[0].logprobs else {}
        gap = abs(top[te[n]].logprob - top[ta[n]].logprob) if ta[n] in top else None
        assert gap is not None and gap <= atol, (
            f"{what}: prompt {i} differs at output token {n}: got {ta[n]}, expected {te[n]} "
            f"(logprob gap {gap}; a near-tie needs <= {atol})\n got {list(ta)}\n exp {list(te)}")


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


@pytest.mark.parametrize("workload", WORKLOADS)
def test_overlap_on_equals_off(cadence_llm: Any, cadence_llm_sync: Any, workload: str) -> None:
    """Async output processing on and off give identical outputs (tokens, text, logprobs,
    finish reasons), greedy and seeded, under preemption and chunked prefill."""
    on = summarize(cached_workload(cadence_llm, workload))
    off = summarize(cached_workload(cadence_llm_sync, workload))
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"prompt {i}: async on {a}\n != async off {b}"
    assert len(on) == len(off)


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


_PROBE_SCRIPT = """
import json, sys
from cadence.plugins import PluginRegistry
reg = PluginRegistry().load()
info = reg.backends.get(sys.argv[1])
loaded = set(sys.modules)
probe = info.cls.probe() if info is not None else None
torch = sys.modules.get("torch")
print(json.dumps({
    "found": info is not None, "backends": sorted(reg.backends),
    "errors": [f"{e.entry_point}: {e.error}" for e in reg.errors],
    "available": getattr(probe, "available", None), "reason": getattr(probe, "reason", None),
    "device_modules": sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:])),
    "imported_by_probe": sorted({m.split(".")[0] for m in set(sys.modules) - loaded}),
    "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
    "torch_imported": torch is not None,
}))
"""


def probe_in_subprocess(name: str, allow_list: str | None = None) -> dict[str, Any]:
    """Load only plugin ``name`` (CADENCE_PLUGINS) in a fresh interpreter and probe it."""
    env = {**os.environ, "CADENCE_PLUGINS": allow_list or name}
    env.pop("CADENCE_DISABLE_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, name, *DEVICE_MODULES],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"probing {name!r} in a fresh process failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_probe_never_initialises_the_device(cadence_backend: str) -> None:
    """In a fresh process, loading the plugin and probing imports no device library and
    initialises no torch device; the entry-point name equals ``Backend.name``."""
    facts = probe_in_subprocess(cadence_backend)
    assert not facts["errors"], f"plugin failed to load: {facts['errors']}"
    assert facts["found"], (f"entry point {cadence_backend!r} registered {facts['backends']}: "
                            "the entry-point name must equal Backend.name")
    assert facts["available"], f"probe says unavailable: {facts['reason']}"
    assert not facts["device_modules"], f"device libraries imported: {facts['device_modules']}"
    assert not facts["cuda_initialized"], "probe (or plugin import) initialised CUDA"


def test_registration_is_idempotent(cadence_backend: str) -> None:
    """Loading the plugins again (as every worker process does) and registering the same
    plugin twice changes nothing and raises nothing."""
    from cadence.plugins import PluginRegistry

    first = PluginRegistry().load()
    assert first.load() is first
    info = first.backends[cadence_backend]
    plugin = next(p for n, p in first.pm.list_name_plugin() if n == cadence_backend)
    first.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    again = PluginRegistry()
    again.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    again.register_plugin(plugin, cadence_backend, info.distribution, info.version)
    assert again.backends[cadence_backend].cls is info.cls
    assert first.backends == PluginRegistry().load().backends
    assert not [e for e in first.errors if e.entry_point == cadence_backend]
