"""Structured output on each backend's path, on the CPU: the bitmask itself (unpacking,
rows, padding for HPU buckets, pickling to a worker), the CUDA overlap order (the bitmask is
computed in post_sample, between launching the forward and sampling), and the HPU backend's
emulation end to end."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from engine_helpers import generate, make_llm
from cadence import SamplingParams, StructuredOutputsParams
from cadence.backend import ModelInput, PostSample, SamplerOutput, SamplingMetadata
from cadence.layers import sampler
from cadence.layers.token_bitmask import apply_grammar_bitmask
from cadence.structured_output.bitmask import GrammarBitmask

V = 70  # not a multiple of 32: the last word is partly past the vocabulary


def _bitmask(allowed: list[set[int]]) -> np.ndarray:
    words = np.zeros((len(allowed), (V + 31) // 32), dtype=np.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            words[r, t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)  # bit 31 set: a negative int32


def test_apply_bitmask_masks_exactly_the_disallowed_tokens_of_its_rows() -> None:
    logits = torch.randn(4, V)
    allowed = [{0, 31, 63}, {5, 64, 69}]
    g = GrammarBitmask([1, 3], value=_bitmask(allowed))
    out = apply_grammar_bitmask(logits, g)
    for r in (0, 2):
        assert torch.equal(out[r], logits[r])
    for r, ids in zip((1, 3), allowed):
        finite = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert finite == ids
        assert torch.equal(out[r, sorted(ids)], logits[r, sorted(ids)])


def test_sampler_only_samples_allowed_tokens_and_logprobs_are_of_the_masked_logits() -> None:
    b = 64
    logits = torch.randn(b, V)
    allowed = [{(7 * r) % V, (7 * r + 33) % V} for r in range(b)]
    meta = SamplingMetadata([1.0] * b, [0] * b, [1.0] * b, [0.0] * b, [None] * b, [0] * b,
                            all_greedy=False, num_logprobs=[2] * b, max_num_logprobs=2)
    meta.grammar = GrammarBitmask(list(range(b)), value=_bitmask(allowed))
    out = sampler.to_host(sampler.sample(logits, meta))
    for r, tok in enumerate(out.sampled_token_ids):
        assert tok in allowed[r]
        _, rank, top_ids, top_lps = out.logprobs[r]
        assert set(top_ids) == allowed[r] and rank <= 2
        assert abs(sum(np.exp(top_lps)) - 1.0) < 1e-5  # the mass of the allowed tokens


def test_hpu_padding_gives_every_bucket_row_a_bitmask_row() -> None:
    from cadence.backends.hpu.sampling import expand_sampling

    meta = SamplingMetadata([1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, [None] * 3, [0] * 3,
                            all_greedy=False)
    calls = []
    meta.grammar = GrammarBitmask([0, 2], lambda: calls.append(1) or _bitmask([{1}, {2}]))
    padded = expand_sampling(meta, [2, None, 1, 0])
    assert padded.grammar.rows == [0, 1, 2, 3]
    words = padded.grammar.get()
    assert words.shape[0] == 4 and calls == [1]
    logits = apply_grammar_bitmask(torch.zeros(4, V), padded.grammar)
    finite = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert finite == [{2}, set(range(V)), set(range(V)), {1}]


def test_pickled_handle_carries_the_bitmask_never_the_function() -> None:
    g = GrammarBitmask([0], lambda: _bitmask([{3}]))
    late = pickle.loads(pickle.dumps(g))
    assert not late.is_ready
    with pytest.raises(RuntimeError, match="never delivered"):
        late.get()
    late.set(g.get())
    assert np.array_equal(late.get(), g.get())
    assert pickle.loads(pickle.dumps(g)).is_ready


def test_cuda_order_computes_the_bitmask_while_the_forward_runs() -> None:
    from cadence.backends.cuda.backend import execute_overlapped

    log: list[str] = []
    logits = torch.randn(1, V)

    class Device:
        def launch(self, mi):
            log.append("dev:launch")
            return logits

        def sample(self, lg, sampling):
            log.append("dev:sample")
            return sampler.sample(lg, sampling)

        def start_copy(self, sampled):
            return sampled

        def finish_copy(self, handle) -> SamplerOutput:
            return sampler.to_host(handle)

    meta = SamplingMetadata([1.0], [0], [1.0], [0.0], [None], [0], all_greedy=False)
    meta.grammar = GrammarBitmask([0], lambda: log.append("host:bitmask") or _bitmask([{9}]))
    mi = ModelInput([1], [0], [0], [1], [1], [[0]], 1, [0], meta)

    def post() -> None:  # what the engine's post_sample does first
        meta.grammar.get()
        log.append("host:finalize")

    out = execute_overlapped(Device(), mi, PostSample(post))
    assert out.sampled_token_ids == [9]
    assert log == ["dev:launch", "host:bitmask", "host:finalize", "dev:sample"]


def test_hpu_emulation_end_to_end(tiny_model_dir, monkeypatch) -> None:
    pytest.importorskip("xgrammar")
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    model = tiny_model_dir("llama")
    regex = r"[a-c]{2,4}-\d{1,2}"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=regex))
              for i, t in enumerate([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])]
    prompts = ["the cat", "a dog sings", "blue", "why", "one two", "hello"]
    llm = make_llm(model, backend="hpu", max_num_seqs=4, max_model_len=128)
    try:
        outs = generate(llm, prompts, params)
        backend = llm.engine.backend
        assert backend.recompiles_after_warmup() == 0
    finally:
        llm.shutdown()
    import re

    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    cpu = make_llm(model)
    try:
        ref = generate(cpu, prompts, params)
    finally:
        cpu.shutdown()
    greedy = [0, 3]
    assert [outs[i].outputs[0].text for i in greedy] == [ref[i].outputs[0].text for i in greedy]
