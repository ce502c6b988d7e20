"""EngineArgs' fields of the wrong type or out of range are ValueErrors naming the field,
before anything loads (core/engine_arg_checks.py): NaN, a float, a bool or a string where a
count goes would otherwise pass the range checks and wedge the engine or fail deep inside it."""

from __future__ import annotations

import math

import pytest

from cadence import EngineArgs


@pytest.mark.parametrize(("field", "value"), [
    ("max_num_seqs", math.nan), ("max_num_batched_tokens", math.nan),
    ("max_model_len", 1.5), ("max_model_len", True), ("max_model_len", "128"),
    ("max_model_len", 0), ("max_num_batched_tokens", 0), ("block_size", 16.0),
    ("num_kv_blocks", math.inf), ("num_kv_blocks", "8"), ("max_num_seqs", "4"),
    ("tensor_parallel_size", 1.5), ("tensor_parallel_size", "2"),
    ("max_worker_restarts", 1.5), ("max_num_samples", math.nan),
    ("step_timeout", "10"), ("step_timeout", math.nan), ("step_timeout", 1e10),
    ("startup_timeout", -1.0), ("async_scheduling", "yes"), ("enable_chunked_prefill", "no"),
    ("pooling_normalize", 1), ("seed", 1.5), ("seed", "abc"), ("seed", True),
    ("seed", 1 << 64), ("model", ""), ("tokenizer", ""), ("backend_options", None),
])
def test_a_field_of_the_wrong_type_or_range_is_named(tiny_model_dir, field, value) -> None:
    kwargs = {"model": tiny_model_dir("llama"), field: value}
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        EngineArgs(**kwargs).create_engine_config()


def test_inf_timeouts_mean_no_limit_and_a_seed_of_none_draws_one(tiny_model_dir) -> None:
    config = EngineArgs(model=tiny_model_dir("llama"), step_timeout=math.inf,
                        startup_timeout=math.inf, seed=None).create_engine_config()
    # The longest wait every select() and join takes: no limit in practice.
    assert config.fault_config.step_timeout_s == 1e7
    assert math.isinf(config.fault_config.startup_timeout_s)
    assert isinstance(config.model_config.seed, int)
    other = EngineArgs(model=tiny_model_dir("llama"), seed=None).create_engine_config()
    assert other.model_config.seed != config.model_config.seed


@pytest.mark.parametrize(("backend", "valid"), [
    ("cpu", "overlap, kv_cache_gb"), ("cuda", "enforce_eager, gpu_memory_utilization"),
    ("hpu", "prompt_bs, prompt_seq")])
def test_an_unknown_backend_option_is_named_with_the_valid_ones(
        tiny_model_dir, monkeypatch, backend, valid) -> None:
    """Every built-in backend refuses a misspelt knob (a CPU-only one, ``overlap``, on the
    others) instead of running without it."""
    from cadence import LLM
    from cadence.backend import ProbeResult

    if backend == "cuda":  # the check comes before anything touches a GPU
        from cadence.backends.cuda.backend import CudaBackend

        monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    with pytest.raises(ValueError, match=rf"unknown {backend} backend option\(s\) "
                                         rf"\['overlapp'\]; valid: {valid}"):
        LLM(model=tiny_model_dir("llama"), backend=backend,
            backend_options={"overlapp": "sync"})
