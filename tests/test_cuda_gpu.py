"""End-to-end tests of the CUDA backend through ``cadence.LLM``; they need an NVIDIA GPU, a
CUDA build of torch and triton, and are skipped with the probe's reason otherwise.

Run on a GPU machine with ``pytest -m cuda tests/test_cuda_gpu.py`` (scripts/
cuda_device_check.sh does). Every test uses float32 so that token-for-token equality with the
CPU backend is a fair demand (no TF32: torch leaves it off for matmuls by default).
"""

from __future__ import annotations

import pytest

from cadence.backends.cuda.backend import OVERLAP_ORDER, CudaBackend

_PROBE = CudaBackend.probe()

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _PROBE.available, reason=f"cuda backend unavailable: {_PROBE.reason}"),
]

PROMPTS = [
    "The quick brown fox",
    "Hello",
    "A much longer prompt that spans more than one KV block of sixteen tokens, surely, yes",
    "1 2 3 4 5",
    "über señor",
    "Ω≈ç√ and more",
]


def _llm(model: str, backend: str = "cuda", **kw):
    from cadence import LLM

    kw.setdefault("max_model_len", 256)
    kw.setdefault("dtype", "float32")
    if backend == "cuda":
        kw.setdefault("num_kv_blocks", 256)  # tests share the GPU: no 0.9-of-the-card caches
    return LLM(model=model, backend=backend, **kw)


def _run(model: str, params, prompts=PROMPTS, **kw) -> list:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_helpers import summarize

    llm = _llm(model, **kw)
    try:
        return summarize(llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.shutdown()


def _greedy(max_tokens: int = 24):
    from cadence import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _seeded():
    from cadence import SamplingParams

    return [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=i, max_tokens=20,
                           logprobs=2) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", ["llama", "llama-mqa", "qwen3"])
def test_greedy_matches_cpu_backend(tiny_model_dir, kind: str) -> None:
    model = tiny_model_dir(kind)
    cpu = _run(model, _greedy(), backend="cpu")
    assert _run(model, _greedy()) == cpu  # graphs (default)
    assert _run(model, _greedy(), backend_options={"enforce_eager": True}) == cpu


def test_overlap_on_equals_off(tiny_model_dir) -> None:
    model = tiny_model_dir("llama")
    on = _run(model, _seeded(), async_scheduling=False)
    off = _run(model, _seeded(), disable_async_output_proc=True)
    assert on == off


def test_async_scheduling_equals_sync(tiny_model_dir) -> None:
    """Placeholders scattered from the last sampled ids on the GPU (graph replays and eager
    steps, cuda_graph_max_bs=4 with 6 prompts), penalties and a stop id included."""
    from cadence import SamplingParams

    model = tiny_model_dir("llama")
    params = _seeded()
    params[1] = SamplingParams(temperature=0.9, seed=5, max_tokens=20, repetition_penalty=1.3,
                               presence_penalty=0.4, n=2)
    params[3] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[5, 7, 11])
    opts = {"cuda_graph_max_bs": 4}
    want = _run(model, params, disable_async_output_proc=True, backend_options=opts)
    assert _run(model, params, async_scheduling=True, backend_options=opts) == want


def test_graphs_on_equals_off_across_buckets(tiny_model_dir) -> None:
    """cuda_graph_max_bs=4 with 6 prompts: decode batches of 5-6 run eagerly, then the
    batch shrinks through buckets 4, 2, 1 as requests of different lengths finish."""
    from cadence import SamplingParams

    model = tiny_model_dir("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    graphs = _run(model, params, backend_options={"cuda_graph_max_bs": 4})
    eager = _run(model, params, backend_options={"enforce_eager": True})
    assert graphs == eager
    assert _run(model, _seeded(), backend_options={"cuda_graph_max_bs": 4}) == _run(
        model, _seeded(), backend_options={"enforce_eager": True})


def test_graph_replays_and_event_order(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), async_scheduling=False,  # the overlap path's order
               backend_options={"record_events": True, "cuda_graph_max_bs": 8})
    backend = llm.engine.backend
    replays: list[int] = []
    original = backend.graphs.replay
    backend.graphs.replay = lambda bucket: (replays.append(bucket), original(bucket))[1]
    try:
        llm.generate(PROMPTS[:3], _greedy(8), use_tqdm=False)
    finally:
        llm.shutdown()
    assert replays and set(replays) <= {4, 2, 1}  # 3 decodes pad to bucket 4
    log = backend.event_log
    assert len(log) % len(OVERLAP_ORDER) == 0
    assert log == list(OVERLAP_ORDER) * (len(log) // len(OVERLAP_ORDER))


def test_kv_cache_sized_from_free_memory(tiny_model_dir) -> None:
    import torch

    llm = _llm(tiny_model_dir("llama"), num_kv_blocks=None,
               backend_options={"gpu_memory_utilization": 0.3, "enforce_eager": True})
    try:
        _, total = torch.cuda.mem_get_info()
        used = torch.cuda.memory_allocated()
        assert used <= 0.3 * total * 1.02
        assert used >= 0.2 * total  # the cache took most of the budget
        out = _greedy(4)
        assert len(llm.generate(PROMPTS[:2], out, use_tqdm=False)) == 2
    finally:
        llm.shutdown()


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif(_PROBE.available and _num_gpus() < 2,
                    reason="tensor parallel needs two GPUs, one per rank")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tensor_parallel_2_matches_one_gpu(tiny_model_dir, kind: str) -> None:
    """TP=2 over NCCL, one GPU per rank (eager), against one GPU: greedy tokens equal and
    logprobs within 1e-4 (the all-reduce sums in another order); async scheduling too."""
    from cadence import SamplingParams

    model = tiny_model_dir(kind)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    one = _run(model, params)
    for async_scheduling in (False, True):
        two = _run(model, params, tensor_parallel_size=2, async_scheduling=async_scheduling)
        assert [row[2] for row in two] == [row[2] for row in one]
        for a, b in zip(one, two, strict=True):
            for da, db in zip(a[6], b[6], strict=True):
                assert [t for t, _, _ in da] == [t for t, _, _ in db]
                assert all(abs(x - y) < 1e-4 for (_, x, _), (_, y, _) in zip(da, db))


def test_prompt_logprobs_embeddings_and_beams_match_cpu(tiny_model_dir) -> None:
    """The paths that read hidden states or several logprobs per step, on the GPU: prompt
    logprobs, embeddings (a prefix-cache hit leaving one token is a decode step, which must
    not replay a graph without hidden states) and beam search, against the CPU backend."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_helpers import assert_same_embeddings, assert_same_prompt_logprobs

    from cadence import BeamSearchParams, PoolingParams, SamplingParams

    model = tiny_model_dir("llama")
    long = {"prompt_token_ids": list(range(5, 38))}  # a repeat hits two blocks, computes one
    lp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    results = {}
    for backend in ("cpu", "cuda"):
        llm = _llm(model, backend)
        try:
            raw = PoolingParams(normalize=False)
            results[backend] = (
                llm.generate(PROMPTS, lp, use_tqdm=False),
                llm.embed([long, *PROMPTS], raw, use_tqdm=False)
                + llm.embed([long], raw, use_tqdm=False),
                llm.beam_search(PROMPTS[:3], beams))
        finally:
            llm.shutdown()
    (lp_cpu, emb_cpu, beam_cpu), (lp_gpu, emb_gpu, beam_gpu) = results["cpu"], results["cuda"]
    assert_same_prompt_logprobs(lp_gpu, lp_cpu, atol=1e-3)
    assert emb_gpu[-1].num_cached_tokens == 32
    assert_same_embeddings(emb_gpu, emb_cpu, atol=1e-3)
    assert [[s.tokens for s in o.sequences] for o in beam_gpu] == \
        [[s.tokens for s in o.sequences] for o in beam_cpu]


def test_bad_words_with_async_scheduling_equal_sync(tiny_model_dir) -> None:
    """Bad words whose prefix ends in the token still on the GPU are checked there."""
    from cadence import SamplingParams

    model = tiny_model_dir("llama")
    free = _llm(model)
    try:
        outs = free.generate(PROMPTS, _greedy(12), use_tqdm=False)
        tok = free.get_tokenizer()
        words = [tok.decode(o.outputs[0].token_ids[4:6]) for o in outs]
    finally:
        free.shutdown()
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[w])
              for w in words]
    opts = {"cuda_graph_max_bs": 4}
    want = _run(model, params, disable_async_output_proc=True, backend_options=opts)
    assert _run(model, params, async_scheduling=True, backend_options=opts) == want
    assert want != _run(model, _greedy(12), disable_async_output_proc=True)


def test_lora_adapters_match_cpu(tiny_model_dir, tmp_path) -> None:
    """LoRA adapters and the base model in one batch on the GPU (steps with adapters run
    eagerly, the others replay graphs) give the CPU backend's tokens, with async
    scheduling."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_lora import make_adapters

    model = tiny_model_dir("llama")
    loras = [None, *make_adapters(model, tmp_path)] * 2
    got = {}
    for backend in ("cpu", "cuda"):
        llm = _llm(model, backend, enable_lora=True, max_loras=2,
                   async_scheduling=backend == "cuda")
        try:
            got[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(
                PROMPTS, _greedy(16), use_tqdm=False, lora_request=loras)]
        finally:
            llm.shutdown()
    assert got["cuda"] == got["cpu"]
    assert len({tuple(t) for t in got["cpu"][:3]}) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_awq_checkpoint_on_the_gpu_kernel(tiny_model_dir, tmp_path, dtype: str) -> None:
    """The compiled Triton GEMM on 4-bit weights (graphs and eager): in fp32 the CPU
    backend's tokens; in bf16 (tensor cores, the tile rounded to bf16) the tokens of the
    same engine on the dequantized weights, near-ties excepted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from cadence import SamplingParams
    from cadence.testing.helpers import assert_same_tokens
    from cadence.testing.packed_checkpoint import write_packed

    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    if dtype == "float32":
        cpu = _run(packed, _greedy(), backend="cpu")
        assert _run(packed, _greedy()) == cpu
        assert _run(packed, _greedy(), backend_options={"enforce_eager": True}) == cpu
        return
    outs = []
    for model in (packed, plain):
        llm = _llm(model, dtype=dtype)
        try:
            outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
            if model == packed:
                assert llm.engine.backend.env_info()["cuda_quantized_linears"] == \
                    "8 at 4 bits"
        finally:
            llm.shutdown()
    assert_same_tokens(outs[0], outs[1], 0.05, "bf16 AWQ vs its dequantized weights")
