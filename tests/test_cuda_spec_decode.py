"""Speculative decoding through the whole CUDA backend on the CPU (interpreted Triton
kernels, simulated decode graphs): steps with drafts run eagerly and sample every draft
row, decode-only steps still replay graphs, and the greedy tokens equal the CPU backend's
without drafts. tests/test_spec_decode.py covers the engine side."""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from engine_helpers import make_llm
from test_spec_decode import make_cycling_model

from cadence import LLM, SamplingParams
from cadence.backend import ProbeResult

PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 600 + 2 for i in range(9)]},
           {"prompt_token_ids": [(5 * i + 11) % 600 + 2 for i in range(4)]}]


@pytest.fixture
def model(tiny_model_dir, tmp_path, monkeypatch) -> str:
    from cadence.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    return make_cycling_model(tiny_model_dir("llama"), tmp_path / "cyc", 4.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
def test_cuda_speculative_decoding_equals_cpu(model) -> None:
    from cadence.backends.cuda import runtime

    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    cpu = make_llm(model, max_model_len=64)
    try:
        want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        cpu.shutdown()
    llm = LLM(model=model, backend="cuda", dtype="float32", max_model_len=64, num_kv_blocks=32,
              backend_options={"device": "cpu", "cuda_graph_max_bs": 4},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    eager, replays = [], []
    launch_eager, replay = runtime.launch_eager, llm.engine.backend.graphs.replay

    def spy_eager(be, mi, previous=None):
        seqs = mi.sample_seq_indices
        eager.append(len(set(seqs)) < len(seqs))  # a step with drafts
        return launch_eager(be, mi, previous)

    try:
        runtime.launch_eager = spy_eager
        llm.engine.backend.graphs.replay = lambda b: replays.append(b) or replay(b)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.engine.stats
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        runtime.launch_eager = launch_eager
        llm.shutdown()
    assert got == want
    assert stats.num_accepted_tokens > 0
    assert any(eager), "no step with drafts ran eagerly"
    assert replays, "decode-only steps stopped replaying graphs"
