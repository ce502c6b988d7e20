"""The conformance checks of the optional features: each passes for a backend that
declares the feature and checks that one that does not refuses it, naming the feature.
Collected through ``cadence.testing.conformance`` (its module doc says how to run them).
"""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing.helpers import (
    PROMPTS,
    assert_all_blocks_free,
    assert_same_tokens,
    cached_workload,
    run_workload,
)

__all__ = [
    "test_embeddings_match_cpu_reference_or_are_refused",
    "test_int8_weights_match_cpu_reference_or_are_refused",
    "test_lora_adapters_match_cpu_reference_or_are_refused",
    "test_packed_checkpoints_match_cpu_reference_or_are_refused",
    "test_prompt_logprobs_equal_the_decode_or_are_refused",
    "test_speculative_decoding_equals_plain_or_is_refused",
]


def test_prompt_logprobs_equal_the_decode_or_are_refused(cadence_llm: Any,
                                                         cadence_logprob_atol: float) -> None:
    """A backend that declares ``supports_prompt_logprobs`` returns, for a prompt made of
    another request's prompt and greedy output, prompt logprobs equal to the logprobs the
    decode steps gave those tokens (the output copy of ``SamplerOutput.prompt_logprobs``);
    one that does not refuses such a request with a ValueError naming the field."""
    from cadence import SamplingParams

    engine = cadence_llm.engine
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    if not engine.backend.supports_prompt_logprobs:
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request("kit-prompt-logprobs", PROMPTS[0], asked)
        assert not engine.has_unfinished_requests()
        return
    (first,) = cadence_llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0), use_tqdm=False)
    sample = first.outputs[0]
    ids = first.prompt_token_ids + sample.token_ids
    (again, _) = cadence_llm.generate([{"prompt_token_ids": ids}, PROMPTS[1]],
                                      [asked, SamplingParams(max_tokens=2)], use_tqdm=False)
    got = again.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None, got
    n = len(first.prompt_token_ids)
    for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        assert abs(got[n + j][token].logprob - entry[token].logprob) <= cadence_logprob_atol, \
            f"token {j}: prompt logprob {got[n + j][token]} vs decode {entry[token]}"
    assert_all_blocks_free(cadence_llm)


def test_embeddings_match_cpu_reference_or_are_refused(
        cadence_llm: Any, cadence_reference_embeddings: list[list[float]],
        cadence_logprob_atol: float) -> None:
    """A backend that declares ``supports_pooling`` returns the vectors the CPU backend's
    sync strategy returns for the same prompts (``SamplerOutput.pooled``: the sums of the
    final hidden states over each span), alone and beside decodes and a longer prefill; one
    that does not refuses embedding requests with a ValueError naming embeddings."""
    from cadence import PoolingParams, SamplingParams

    engine = cadence_llm.engine
    if not engine.backend.supports_pooling:
        with pytest.raises(ValueError, match="embeddings"):
            engine.add_request("kit-embed", PROMPTS[0], PoolingParams())
        assert not engine.has_unfinished_requests()
        return
    alone = cadence_llm.embed(PROMPTS[:3], use_tqdm=False)
    engine.add_request("kit-embed-neighbour", PROMPTS[-1],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    mixed = cadence_llm.embed(PROMPTS[:3], use_tqdm=False)
    for i, want in enumerate(cadence_reference_embeddings):
        for how, out in (("alone", alone[i]), ("beside other requests", mixed[i])):
            got = out.outputs.embedding
            assert len(got) == len(want), (len(got), len(want))
            worst = max(abs(a - b) for a, b in zip(got, want))
            assert worst <= cadence_logprob_atol, \
                f"prompt {i} {how}: the vector differs from the CPU reference by {worst}"
    assert_all_blocks_free(cadence_llm)


def test_lora_adapters_match_cpu_reference_or_are_refused(
        cadence_model_dir: str, cadence_backend: str, cadence_backend_options: dict[str, Any],
        cadence_lora_reference: tuple[list[Any], list[Any] | None],
        cadence_logprob_atol: float) -> None:
    """A backend that declares ``supports_lora`` gives the CPU backend's greedy tokens for
    the base model and two adapters (some projections at rank 8, all at rank 4) in one
    batch (near-ties excepted); one that does not refuses ``enable_lora`` at start-up,
    naming LoRA. A model whose family takes no adapters is refused either way."""
    from cadence.testing.helpers import LORA_PARAMS, lora_workload
    from cadence.testing.pytest_plugin import _make_llm

    adapters, want = cadence_lora_reference
    try:
        llm = _make_llm(cadence_model_dir, cadence_backend,
                        backend_options=cadence_backend_options, enable_lora=True,
                        max_loras=2)
    except ValueError as e:
        family = want is None and "LoRA adapters are supported for" in str(e)
        assert family or "LoRA adapters are not supported by backend" in str(e), str(e)
        return
    try:
        assert want is not None, "enable_lora was accepted for a family that takes none"
        prompts, loras = lora_workload(adapters)
        got = llm.generate(prompts, LORA_PARAMS, use_tqdm=False, lora_request=loras)
        assert_same_tokens(got, want, cadence_logprob_atol, "LoRA adapters")
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_speculative_decoding_equals_plain_or_is_refused(
        cadence_model_dir: str, cadence_backend: str, cadence_backend_options: dict[str, Any],
        cadence_llm: Any, cadence_logprob_atol: float) -> None:
    """A backend that declares ``supports_speculative`` gives its own greedy tokens with
    n-gram drafts (several rows sampled per sequence, most drafts turned down on the kit's
    random weights), near-ties excepted, with every block free at the end; one that does
    not refuses ``speculative_config`` at start-up, naming the backends that can."""
    from cadence.plugins import get_registry
    from cadence.testing.pytest_plugin import _make_llm

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    cls = get_registry().backends[cadence_backend].cls
    if not getattr(cls, "supports_speculative", False):
        with pytest.raises(ValueError, match="speculative decoding is not supported"):
            _make_llm(cadence_model_dir, cadence_backend, speculative_config=spec,
                      backend_options=cadence_backend_options)
        return
    llm = _make_llm(cadence_model_dir, cadence_backend, speculative_config=spec,
                    backend_options=cadence_backend_options)
    try:
        got = run_workload(llm, "greedy")
        assert llm.engine.stats.num_draft_tokens > 0, "no draft was ever computed"
    finally:
        llm.shutdown()
    assert_same_tokens(got, cached_workload(cadence_llm, "greedy"), cadence_logprob_atol,
                       "speculative decoding vs plain decoding")


def test_int8_weights_match_cpu_reference_or_are_refused(
        cadence_model_dir: str, cadence_backend: str, cadence_backend_options: dict[str, Any],
        cadence_logprob_atol: float) -> None:
    """A backend that runs ``int8`` (``Backend.supports_quantization``) gives the CPU
    backend's greedy tokens on int8 weights (near-ties excepted), every block free at the
    end; one that does not refuses it at start-up, naming the backends that run it."""
    from cadence.plugins import get_registry
    from cadence.testing.pytest_plugin import _make_llm

    cls = get_registry().backends[cadence_backend].cls
    if "int8" not in getattr(cls, "supports_quantization", ()):
        with pytest.raises(ValueError, match="quantization 'int8' is not supported"):
            _make_llm(cadence_model_dir, cadence_backend, quantization="int8",
                      backend_options=cadence_backend_options)
        return
    assert_same_tokens(*_here_and_on_reference(cadence_model_dir, cadence_backend,
                                               cadence_backend_options, quantization="int8"),
                       cadence_logprob_atol, "int8 weights vs the CPU backend's")


def test_packed_checkpoints_match_cpu_reference_or_are_refused(
        cadence_model_dir: str, cadence_backend: str, cadence_backend_options: dict[str, Any],
        cadence_logprob_atol: float, tmp_path: Any) -> None:
    """An AWQ checkpoint of the kit's model (``cadence.testing.packed_checkpoint``, the
    method its quantization_config names): a backend that runs ``awq`` gives the CPU
    backend's greedy tokens on it (near-ties excepted), every block free at the end; one
    that does not refuses the checkpoint at start-up, saying it is quantized with awq."""
    from cadence.plugins import get_registry
    from cadence.testing.packed_checkpoint import write_packed
    from cadence.testing.pytest_plugin import _make_llm

    packed, _ = write_packed(cadence_model_dir, tmp_path, "awq")
    cls = get_registry().backends[cadence_backend].cls
    if "awq" not in getattr(cls, "supports_quantization", ()):
        with pytest.raises(ValueError, match="is quantized with awq"):
            _make_llm(packed, cadence_backend, backend_options=cadence_backend_options)
        return
    assert_same_tokens(*_here_and_on_reference(packed, cadence_backend,
                                               cadence_backend_options),
                       cadence_logprob_atol, "an AWQ checkpoint vs the CPU backend's")


def _here_and_on_reference(model: str, backend: str, options: dict[str, Any],
                           **engine_args: Any) -> tuple[Any, Any]:
    """The greedy workload on ``backend`` and on the CPU reference, each engine with every
    block free at the end."""
    from cadence.testing.pytest_plugin import REFERENCE_BACKEND, _make_llm

    results = []
    for name, opts in ((backend, options), (REFERENCE_BACKEND, {})):
        llm = _make_llm(model, name, backend_options=opts, **engine_args)
        try:
            results.append(run_workload(llm, "greedy"))
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    return results[0], results[1]
