"""Async scheduling through the whole CUDA backend on the CPU (interpreted Triton kernels,
simulated decode graphs over the static input buffer, the side-stream copier's double
buffer): outputs equal the sync engine's, placeholders are filled on the graph path and the
eager path, two steps are in flight, and ``submit`` never waits on a copy still running.

As in tests/test_cuda_kernels.py, ``TRITON_INTERPRET=1`` is set before triton is first
imported when there is no GPU; one launch costs ~0.2 s there, so the workload stays small.
The scatter kernel itself is checked against torch in tests/test_cuda_kernels.py.
"""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from engine_helpers import summarize
from test_async_scheduling import SubmitSpy

from cadence import LLM, SamplingParams
from cadence.backend import ProbeResult

PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 600 + 2 for i in range(9)]},
           {"prompt_token_ids": [(5 * i + 11) % 600 + 2 for i in range(4)]},
           {"prompt_token_ids": [(3 * i + 1) % 600 + 2 for i in range(6)]}]


class _Event:
    """Stands in for a CUDA event: knows whether the copy it was recorded after is done."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.pending = log, False

    def record(self, stream: object = None) -> None:
        self.pending = True

    def synchronize(self) -> None:
        self.log.append("wait pending copy" if self.pending else "wait done copy")
        self.pending = False


def _llm(model: str, **kw) -> LLM:
    # A token budget of 8: prompts are chunked, so some steps mix prefill chunks with decodes
    # on placeholders (the eager path) and others are decode-only (the graph path).
    return LLM(model=model, backend="cuda", dtype="float32", max_model_len=64,
               num_kv_blocks=32, max_num_batched_tokens=8, backend_options={"device": "cpu", "cuda_graph_max_bs": 4,
                                                  "record_events": True}, **kw)


def _params(stop_id: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.4, n=2),
            SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id])]


@pytest.fixture
def model(tiny_model_dir, monkeypatch) -> str:
    from cadence.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    return tiny_model_dir("llama")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
def test_cuda_async_scheduling_equals_sync_on_cpu(model) -> None:
    ref = _llm(model, disable_async_output_proc=True)
    try:
        first = ref.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6,
                                                        ignore_eos=True), use_tqdm=False)
        stop_id = first[0].outputs[0].token_ids[2]
        # Row by row without the request ids (this engine numbered one request more).
        want = [r[1:] for r in summarize(ref.generate(PROMPTS, _params(stop_id),
                                                      use_tqdm=False))]
    finally:
        ref.shutdown()
    llm = _llm(model, async_scheduling=True)
    be = llm.engine.backend
    spy = SubmitSpy(llm.engine)
    log = be.event_log
    waits: list[str] = []
    be.copier._events = [_Event(waits), _Event(waits)]
    replays: list[list[int]] = []  # the graph's static input ids at each replay
    replay = be.graphs.replay
    be.graphs.replay = lambda b: (replays.append(be.graphs.views.input_ids[:b].tolist()),
                                  replay(b))[1]
    submit = be.submit

    paths: set[str] = set()

    def submit_spy(mi):
        waits.append("submit")
        if mi.placeholder_idx:
            paths.add("graph" if mi.is_decode_only and mi.num_seqs <= 4 else "eager")
        submit(mi)

    be.submit = submit_spy
    try:
        got = [r[1:] for r in summarize(llm.generate(PROMPTS, _params(stop_id),
                                                     use_tqdm=False))]
    finally:
        llm.shutdown()
    assert got == want
    assert any(row[4] == stop_id for row in got)
    assert spy.num_placeholders > 0 and spy.num_penalty_placeholders > 0
    assert paths == {"graph", "eager"}
    # The decode graph replayed on filled ids: never a placeholder (-1) in its inputs.
    assert replays and all(-1 not in ids for ids in replays)
    # Two steps in flight: a step's copy starts before the previous one is collected.
    assert log[:7] == ["launch", "sample", "copy", "launch", "sample", "copy", "sync"]
    # submit only ever waits on a copy buffer whose copy was already collected.
    assert "wait pending copy" not in [w for i, w in enumerate(waits)
                                       if i and waits[i - 1] == "submit"]


def test_placeholders_after_a_failed_step_are_refused() -> None:
    from types import SimpleNamespace

    from cadence.backend import ModelInput, SamplingMetadata
    from cadence.backends.cuda import runtime

    meta = SamplingMetadata([0.0], [0], [1.0], [0.0], [None], [0], True)
    mi = ModelInput([-1], [4], [4], [1], [5], [[0]], 1, [0], meta, placeholder_idx=[0],
                    placeholder_src=[0])
    be = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="stale"):
        runtime.fill_placeholders(be, torch.zeros(1, dtype=torch.int64), mi, None)
    ids = torch.tensor([-1, 7])
    mi.placeholder_idx, mi.placeholder_src = [0], [1]
    runtime.fill_placeholders(be, ids, mi, torch.tensor([3, 9]))
    assert ids.tolist() == [9, 7]


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_come_back_with_the_samples(model, async_scheduling) -> None:
    """Chunked prefills run eagerly through ModelRunner.run_model, which computes the prompt
    logprobs; the output copier brings them to the host beside the samples, and they equal
    the CPU backend's."""
    from engine_helpers import assert_same_prompt_logprobs, make_llm

    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11, 40, 2, 7, 7, 30, 8, 1], [3, 4])]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
    cpu = make_llm(model, max_model_len=64)
    try:
        want = cpu.generate(prompts, params, use_tqdm=False)
    finally:
        cpu.shutdown()
    llm = _llm(model, async_scheduling=async_scheduling)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [a.outputs[0].token_ids for a in got] == [b.outputs[0].token_ids for b in want]
    assert all(w.prompt_logprobs is not None for w in want)
    assert_same_prompt_logprobs(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embeddings_come_back_with_the_samples(model, async_scheduling) -> None:
    """Embedding prompts run eagerly, also when a prefix-cache hit leaves one token to
    compute (a step the scheduler counts as a decode, which would otherwise replay a
    graph that returns no hidden states); the pooled sums come back through the output
    copier and equal the CPU backend's, beside generation requests."""
    from engine_helpers import assert_same_embeddings, make_llm

    from cadence import PoolingParams

    long = list(range(5, 38))  # 33 tokens: a repeat hits two 16-token blocks, computes one
    prompts = [{"prompt_token_ids": p} for p in (long, [3, 4, 9], long)]
    cpu = make_llm(model, max_model_len=64)
    try:
        want = cpu.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    finally:
        cpu.shutdown()
    llm = _llm(model, async_scheduling=async_scheduling)
    try:
        eng = llm.engine
        eng.add_request("g", {"prompt_token_ids": [7, 8]},
                        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        got = llm.embed(prompts[:2], PoolingParams(normalize=False), use_tqdm=False)
        (again,) = llm.embed(prompts[2:], PoolingParams(normalize=False), use_tqdm=False)
        assert again.num_cached_tokens == 32
        assert_same_embeddings([*got, again], want)
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
def test_bad_words_with_async_scheduling_equal_the_cpu_backend(model) -> None:
    """A bad word whose second-to-last token is the newest output, still on the device when
    the next step is planned, is checked on the device (the sampler's ban_if_newest)."""
    from engine_helpers import make_llm

    cpu = make_llm(model, max_model_len=64)
    try:
        free = cpu.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
        # Words made of what the free run says: two tokens each, as the tokenizer reads them.
        tok = cpu.get_tokenizer()
        words = [[tok.decode(o.outputs[0].token_ids[3:5])] for o in free]
        params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=w)
                  for w in words]
        want = cpu.generate(PROMPTS, params, use_tqdm=False)
    finally:
        cpu.shutdown()
    llm = _llm(model, async_scheduling=True)
    try:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in want] != [o.outputs[0].token_ids for o in free]


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_gpu.py covers it on a GPU")
def test_lora_steps_run_eagerly(model, tmp_path) -> None:
    """Decode steps with LoRA adapters run eagerly: the captured graphs hold no adapter
    updates, so a replay would drop them. Tokens equal the CPU backend's, adapters and the
    base model in one batch, with async scheduling."""
    from engine_helpers import make_llm
    from test_lora import make_adapters

    loras = [None, *make_adapters(model, tmp_path)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cpu = make_llm(model, max_model_len=64, enable_lora=True, max_loras=2)
    try:
        want = [list(o.outputs[0].token_ids) for o in cpu.generate(
            PROMPTS, params, use_tqdm=False, lora_request=loras)]
    finally:
        cpu.shutdown()
    assert len({tuple(w) for w in want}) == 3
    llm = _llm(model, async_scheduling=True, enable_lora=True, max_loras=2)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            PROMPTS, params, use_tqdm=False, lora_request=loras)]
        assert got == want
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
